"""Modal compatibility, the pure parts (issue 18): ``Sandbox.create``'s options onto
ray_sandbox's, refusals by name, Modal's exception names, App/Image/Secret, and how a
stream reader cuts output. Written from Modal's public docs (modal.com/docs)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

import ray_sandbox.modal as modal
from ray_sandbox.modal._options import UNSUPPORTED, create_options
from ray_sandbox.modal.io import StreamReader
from ray_sandbox.runtime import errors
from ray_sandbox.runtime.config import EgressPolicy, make_config
from ray_sandbox.runtime.errors import ConfigError, SandboxNotFoundError


def _options(**kw):
    base = dict(image=None, app=None, name=None, tags=None, env=None, secrets_env=[],
                timeout=300, workdir=None, cpu=None, memory=None, block_network=False,
                cidr_allowlist=None, outbound_domain_allowlist=None, others={})
    return create_options(**{**base, **kw})


def test_defaults_are_modals():
    assert _options() == {"image": "ray-sandbox/python", "env": {}, "labels": {},
                          "network": "public", "ttl_seconds": 300}


def test_options_map_onto_config_fields():
    out = _options(image="ray-sandbox/busybox", app="my-app", name="n", tags={"k": "v"},
                   env={"A": "1", "UNSET": None}, secrets_env=[{"A": "0", "B": "2"}],
                   timeout=60, workdir="/w", cpu=(0.5, 2.0), memory=256)
    assert out == {"image": "ray-sandbox/busybox", "env": {"A": "1", "B": "2"},
                   "labels": {"k": "v", "modal.app": "my-app"}, "network": "public",
                   "ttl_seconds": 60, "name": "n", "workdir": "/w", "cpu": 2.0,
                   "memory": "256Mi"}
    cfg = make_config(**{k: v for k, v in out.items() if k != "name"})
    assert (cfg.memory, cfg.cpu, cfg.network) == (256 * 2**20, 2.0, "public")


def test_unencrypted_ports_are_published_on_the_node():
    out = _options(unencrypted_ports=[8080, 9000])
    assert out["expose_ports"] == (8080, 9000) and out["network"] == "public"
    assert out["labels"] == {"modal.ports": "8080,9000"}
    assert modal.Tunnel.node_local("127.0.0.1", 8080).tcp_socket == ("127.0.0.1", 8080)
    assert modal.Tunnel.node_local("10.0.0.2", 80).url == "http://10.0.0.2:80"
    with pytest.raises(NotImplementedError, match="TLS"):
        _ = modal.Tunnel.node_local("h", 1).tls_socket


def test_encrypted_ports_are_published_and_go_through_the_service(monkeypatch):
    out = _options(unencrypted_ports=[8080], encrypted_ports=[8080, 443])
    assert out["expose_ports"] == (8080, 443)  # each port once
    assert out["labels"] == {"modal.ports": "8080", "modal.encrypted_ports": "8080,443"}
    monkeypatch.delenv("RAY_SANDBOX_SERVICE_APP", raising=False)
    with pytest.raises(NotImplementedError, match="RAY_SANDBOX_SERVICE_APP"):
        modal.Sandbox.create(encrypted_ports=[443])  # refused before anything is made
    served = modal.Tunnel("svc.example", 443, url="https://svc.example/api/v1/ports/x/1/t/")
    with pytest.raises(NotImplementedError, match="use url"):
        _ = served.tls_socket  # it would reach the service, not the port
    with pytest.raises(modal.exception.InvalidError, match="unencrypted"):
        _ = served.tcp_socket


def test_network_options():
    assert _options(block_network=True)["network"] == "none"
    out = _options(cidr_allowlist=["10.1.0.0/16"], outbound_domain_allowlist=["pypi.org"])
    assert out["network"] == "public"
    assert out["egress"] == EgressPolicy(allow_cidrs=("10.1.0.0/16",),
                                         allow_domains=("pypi.org",), default="deny")
    with pytest.raises(modal.exception.InvalidError):
        _options(block_network=True, cidr_allowlist=[])


@pytest.mark.parametrize("key", sorted(UNSUPPORTED))
def test_unsupported_options_are_refused_by_name(key):
    _options(others={key: None})  # the default passes
    with pytest.raises(NotImplementedError, match=key):
        _options(others={key: 1})


def test_an_unknown_option_is_a_type_error_as_in_python():
    with pytest.raises(TypeError, match="bogus"):
        _options(others={"bogus": False})


def test_app_image_secret():
    app = modal.App.lookup("my-app", create_if_missing=True)
    assert app.app_id == app.name == "my-app"
    assert modal.App.lookup.__name__ == "lookup"
    assert asyncio.run(modal.App.lookup.aio("x")).name == "x"
    assert modal.Image.from_registry("python:3.12-slim").ref == "python:3.12-slim"
    assert modal.Image.debian_slim().ref == "ray-sandbox/python"
    with pytest.warns(UserWarning, match="nearest"):  # the nearest offered, 3.11 or 3.13
        assert modal.Image.debian_slim(python_version="3.12").ref == "ray-sandbox/python:3.13"
    with pytest.raises(modal.exception.InvalidError, match="python_version"):
        modal.Image.debian_slim(python_version="3.8")
    with pytest.raises(NotImplementedError, match="pip_install"):
        modal.Image.debian_slim().pip_install("numpy")
    with pytest.raises(NotImplementedError, match="add_python"):
        modal.Image.from_registry("x", add_python="3.11")
    assert modal.Secret.from_dict({"A": "1", "B": None}).env == {"A": "1"}
    with pytest.raises(NotImplementedError, match="secret store"):
        modal.Secret.from_name("s")
    with pytest.raises(modal.exception.NotFoundError):
        modal.Secret.from_local_environ(["RAY_SANDBOX_SURELY_UNSET_VARIABLE"])


# Modal's exception names -> (the class, what else catches it)
MODAL = {
    "Error": (errors.ModalError, ()),
    "InvalidError": (errors.ModalInvalidError, (ConfigError, ValueError)),
    "NotFoundError": (errors.ModalNotFoundError, (SandboxNotFoundError,)),
    "SandboxTerminatedError": (errors.ModalSandboxTerminatedError, ()),
    "TimeoutError": (errors.ModalTimeoutError, (TimeoutError,)),
    "SandboxTimeoutError": (errors.ModalSandboxTimeoutError, (errors.ModalTimeoutError,)),
    "ExecTimeoutError": (errors.ModalExecTimeoutError, (errors.ModalTimeoutError,)),
}


def test_every_modal_exception_name():
    assert set(MODAL) == set(modal.exception.__all__)
    assert set(errors.MODAL_NAMES.values()) == set(MODAL)
    for name, (cls, also) in MODAL.items():
        assert getattr(modal.exception, name) is cls
        assert cls.__name__ == name and cls.__module__ == "ray_sandbox.modal.exception"
        err = cls("boom", sandbox_id="ab" * 16)
        assert isinstance(err, errors.ModalError | errors.SandboxError)
        assert all(isinstance(err, c) for c in also)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) == f"boom | sandbox={'ab' * 16}"


def test_stream_reader_cuts_chunks_and_lines():
    chunks = [b"fo", b"o\nb", "é".encode()[:1], "é".encode()[1:] + b"\nlast"]
    assert list(StreamReader(iter(chunks), text=True, by_line=True)) == ["foo\n", "bé\n",
                                                                           "last"]
    assert StreamReader(iter(chunks), text=True, by_line=False).read() == "foo\nbé\nlast"
    assert list(StreamReader(iter(chunks), text=False, by_line=True)) == [
        b"foo\n", "bé\n".encode(), b"last"]

    async def lines():
        return [x async for x in StreamReader(iter(chunks), text=True, by_line=True)]
    assert asyncio.run(lines()) == ["foo\n", "bé\n", "last"]
