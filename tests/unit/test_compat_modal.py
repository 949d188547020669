"""Modal compatibility, the pure parts (issues 18 and 33): ``Sandbox.create``'s options onto
ray_sandbox's, refusals by name, Modal's exception names, App/Image/Secret, how a stream
reader cuts output, the image DSL's Dockerfile, probes, and docs/compat.md's Modal tables
against the facade's names. Written from Modal's public docs (modal.com/docs) and its
client's signatures."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import enum
import inspect
import pickle
import re
import textwrap
from pathlib import Path

import pytest

import ray_sandbox.modal as modal
from ray_sandbox.modal import output
from ray_sandbox.modal._build import with_build_ca
from ray_sandbox.modal._options import UNSUPPORTED, create_options
from ray_sandbox.modal._probe import listening
from ray_sandbox.modal._refuse import is_refused
from ray_sandbox.modal.image import _place
from ray_sandbox.modal.io import StreamReader
from ray_sandbox.modal.sandbox_fs import modal_error
from ray_sandbox.runtime import errors
from ray_sandbox.runtime.config import EgressPolicy, make_config
from ray_sandbox.runtime.errors import ConfigError, SandboxNotFoundError
from ray_sandbox.runtime.snapshot import Snapshot


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
    assert modal.Tunnel._node_local("127.0.0.1", 8080).tcp_socket == ("127.0.0.1", 8080)
    assert modal.Tunnel._node_local("10.0.0.2", 80).url == "http://10.0.0.2:80"
    with pytest.raises(NotImplementedError, match="TLS"):
        _ = modal.Tunnel._node_local("h", 1).tls_socket


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
    with pytest.raises(NotImplementedError, match="micromamba_install"):
        modal.Image.debian_slim().micromamba_install("numpy")
    with pytest.raises(NotImplementedError, match="add_python"):
        modal.Image.from_registry("x", add_python="3.11")
    assert modal.Secret.from_dict({"A": "1", "B": None}).env == {"A": "1"}
    with pytest.raises(NotImplementedError, match="Secret.from_name.*secret store"):
        modal.Secret.from_name("s")
    with pytest.raises(modal.exception.NotFoundError):
        modal.Secret.from_local_environ(["RAY_SANDBOX_SURELY_UNSET_VARIABLE"])


# Modal's exception names -> (the class, what else catches it): those the facade raises
MODAL = {
    "Error": (errors.ModalError, ()),
    "InvalidError": (errors.ModalInvalidError, (ConfigError, ValueError)),
    "ConflictError": (errors.ModalConflictError, (errors.ModalInvalidError,)),
    "NotFoundError": (errors.ModalNotFoundError, (SandboxNotFoundError,)),
    "AlreadyExistsError": (errors.ModalAlreadyExistsError, (errors.SandboxExistsError,)),
    "SandboxTerminatedError": (errors.ModalSandboxTerminatedError, ()),
    "TimeoutError": (errors.ModalTimeoutError, (TimeoutError,)),
    "SandboxTimeoutError": (errors.ModalSandboxTimeoutError, (errors.ModalTimeoutError,)),
    "ExecTimeoutError": (errors.ModalExecTimeoutError, (errors.ModalTimeoutError,)),
    "ImageBuildError": (errors.ModalImageBuildError, (errors.ImageBuildError,)),
    "SandboxFilesystemError": (errors.ModalSandboxFilesystemError, (errors.SandboxFileError,)),
    "SandboxFilesystemNotFoundError": (errors.ModalSandboxFilesystemNotFoundError,
                                       (FileNotFoundError,)),
    "SandboxFilesystemIsADirectoryError": (errors.ModalSandboxFilesystemIsADirectoryError,
                                           (IsADirectoryError,)),
    "SandboxFilesystemNotADirectoryError": (errors.ModalSandboxFilesystemNotADirectoryError,
                                            (NotADirectoryError,)),
    "SandboxFilesystemPathAlreadyExistsError": (
        errors.ModalSandboxFilesystemPathAlreadyExistsError, (FileExistsError,)),
    "SandboxFilesystemPermissionError": (errors.ModalSandboxFilesystemPermissionError,
                                         (PermissionError,)),
    "SandboxFilesystemFileTooLargeError": (errors.ModalSandboxFilesystemFileTooLargeError,
                                           (errors.FileTooLargeError,)),
    "SandboxFilesystemDirectoryNotEmptyError": (
        errors.ModalSandboxFilesystemDirectoryNotEmptyError,
        (errors.ModalSandboxFilesystemError,)),
}
# Modal 1.6.4's modal.exception, every public class (read from the installed client)
MODAL_1_6_EXCEPTIONS = {
    "AlreadyExistsError", "AsyncUsageWarning", "AuthError", "ClientClosed", "ConflictError",
    "ConnectionError", "DataLossError", "DeprecationError", "DeserializationError", "Error",
    "ExecTimeoutError", "ExecutionError", "FunctionTimeoutError", "ImageBuildError",
    "InputCancellation", "InteractiveTimeoutError", "InternalAPIWarning", "InternalError",
    "InternalFailure", "InvalidError", "LogsFetchError", "ModuleNotMountable",
    "MountUploadTimeoutError", "NotFoundError", "OutputExpiredError", "PermissionDeniedError",
    "RemoteError", "RequestSizeError", "ResourceExhaustedError",
    "SandboxFilesystemDirectoryNotEmptyError", "SandboxFilesystemError",
    "SandboxFilesystemFileTooLargeError", "SandboxFilesystemIsADirectoryError",
    "SandboxFilesystemNotADirectoryError", "SandboxFilesystemNotFoundError",
    "SandboxFilesystemPathAlreadyExistsError", "SandboxFilesystemPermissionError",
    "SandboxTerminatedError", "SandboxTimeoutError", "SerializationError", "ServerWarning",
    "ServiceError", "SnapshotCreationError", "TimeoutError", "UnimplementedError",
    "UserCodeException", "VersionError", "VolumeUploadTimeoutError",
    "WorkspaceManagementError",
}


def test_every_modal_exception_name():
    classes = set(modal.exception.__all__) - {"simulate_preemption"}
    assert classes == MODAL_1_6_EXCEPTIONS == set(errors.MODAL_NAMES.values())
    with pytest.raises(NotImplementedError, match="simulate_preemption"):
        modal.exception.simulate_preemption()
    for name in classes:  # each under Modal's name, where pickle finds it
        cls = getattr(modal.exception, name)
        assert cls.__name__ == name and cls.__module__ == "ray_sandbox.modal.exception"
        assert pickle.loads(pickle.dumps(cls)) is cls
        if issubclass(cls, Warning):
            assert issubclass(cls, UserWarning)
        elif not issubclass(cls, errors.SandboxError):
            assert name in ("InputCancellation", "ModuleNotMountable", "UserCodeException")
    assert issubclass(modal.exception.InputCancellation, BaseException)
    assert not issubclass(modal.exception.InputCancellation, Exception)
    for name, (cls, also) in MODAL.items():
        assert getattr(modal.exception, name) is cls
        err = cls("boom", sandbox_id="ab" * 16)
        assert isinstance(err, errors.ModalError | errors.SandboxError)
        assert all(isinstance(err, c) for c in also)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) == f"boom | sandbox={'ab' * 16}"
    built = modal.exception.ImageBuildError("x", step="RUN false", log_tail="t")
    back = pickle.loads(pickle.dumps(built))
    assert (back.step, back.log_tail) == ("RUN false", "t")


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


# --- issue 33: the names Modal's sandbox guide and examples use --------------------------


def test_create_options_of_modal_1_6():
    out = _options(cidr_allowlist=None, outbound_cidr_allowlist=["1.2.0.0/16"])
    assert out["egress"] == EgressPolicy(allow_cidrs=("1.2.0.0/16",), default="deny")
    assert _options(outbound_cidr_allowlist=[])["egress"] == EgressPolicy(default="deny")
    with pytest.raises(modal.exception.InvalidError, match="old name"):
        _options(cidr_allowlist=[], outbound_cidr_allowlist=[])
    # a limit: what the sandbox may use, which is what it reserves
    assert _options(cpu=0.5, cpu_limit=2.0, memory=256, memory_limit=1024) == _options(
        cpu=(0.5, 2.0), memory=(256, 1024))
    assert _options(cpu_limit=2.0)["cpu"] == 2.0 and _options(memory_limit=64)["memory"] == "64Mi"
    with pytest.raises(modal.exception.InvalidError, match="below"):
        _options(cpu=2.0, cpu_limit=1.0)
    with pytest.raises(modal.exception.InvalidError, match="both"):
        _options(memory=(1, 2), memory_limit=3)
    assert "network" in _options(runtime="gvisor")
    assert _options(snapshots=True)["network"] == "sandbox"  # runsc checkpoints its netstack
    assert _options(snapshots=True, block_network=True)["network"] == "none"
    with pytest.raises(NotImplementedError, match="runtime='vm'"):
        _options(runtime="vm")
    probe = modal.Probe.with_exec("true")
    assert _options(probe=probe._label())["labels"] == {"modal.probe": probe._label()}


def test_probe():
    assert modal.Probe.with_tcp(8080) == modal.Probe(tcp_port=8080, interval_ms=100)
    p = modal.Probe.with_exec("sh", "-c", "test -f /tmp/ready", interval_ms=50)
    assert p.exec_argv == ("sh", "-c", "test -f /tmp/ready") and p.interval_ms == 50
    assert modal.Probe._from_label(p._label()) == p
    for bad in (lambda: modal.Probe(), lambda: modal.Probe(tcp_port=1, exec_argv=("x",)),
                lambda: modal.Probe.with_tcp(0), lambda: modal.Probe.with_tcp("80"),
                lambda: modal.Probe.with_exec(), lambda: modal.Probe.with_exec("a", 1),
                lambda: modal.Probe.with_tcp(80, interval_ms=0)):
        with pytest.raises(modal.exception.InvalidError):
            bad()
    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr\n"
             "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00\n"
             "   1: 0100007F:1F91 0100007F:1F90 01 00000000:00000000 00\n")
    assert listening(table, 8080) and not listening(table, 8081)  # 8081 only connected
    assert not listening("header only\n", 8080)


def test_dsl_becomes_one_dockerfile(tmp_path):
    (tmp_path / "app.py").write_text("print(1)\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "keep.txt").write_text("k")
    (tmp_path / "dir" / "skip.venv").write_text("s")
    image = (modal.Image.debian_slim()
             .apt_install("nodejs", ["ruby", "php"])
             .pip_install("jupyter~=1.1.0", pre=True)
             .uv_pip_install("fastapi[standard]")
             .run_commands("echo a", "echo $HOME", env={"X": "1 2"})
             .env({"A": "x $y", "B": "2"})
             .workdir("/app")
             .add_local_file(tmp_path / "app.py", "/app/")
             .add_local_dir(tmp_path / "dir", "/data", ignore=["*.venv"])
             .entrypoint([]))
    assert image._recipe.text() == (
        "FROM ray-sandbox/python\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs ruby "
        "php && rm -rf /var/lib/apt/lists/*\n"
        "RUN python -m pip install --no-cache-dir --pre 'jupyter~=1.1.0'\n"
        "RUN (command -v uv >/dev/null 2>&1 || python -m pip install --no-cache-dir uv) && "
        "uv pip install --system --no-cache 'fastapi[standard]'\n"
        "RUN export X='1 2' && echo a\n"
        "RUN export X='1 2' && echo $HOME\n"
        'ENV A="x \\$y" B="2"\n'
        'WORKDIR "/app"\n'
        'COPY .rsb/0/app.py "/app/app.py"\n'
        'COPY .rsb/1/dir "/data"\n'
        "ENTRYPOINT []\n")
    ctx = tmp_path / "ctx"
    for f in image._recipe.files:
        _place(f, ctx)
    assert sorted(str(p.relative_to(ctx)) for p in ctx.rglob("*") if p.is_file()) == [
        ".rsb/0/app.py", ".rsb/1/dir/keep.txt"]
    # nothing is built until a sandbox needs it; metadata alone needs no build
    assert modal.Image.from_registry("python:3.11-slim").entrypoint([]).ref == \
        "python:3.11-slim"
    assert modal.Image.debian_slim().cmd(["sleep", "1"]).object_id == "ray-sandbox/python"
    assert modal.Image.debian_slim().pip_install() is not None  # nothing to install: as is
    with pytest.raises(modal.exception.InvalidError, match="empty image"):
        _ = modal.Image.from_scratch().ref


def test_from_dockerfile_takes_what_copy_names(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("a")
    (tmp_path / "req.txt").write_text("six\n")
    (tmp_path / "unrelated.bin").write_bytes(b"x" * 10)
    df = tmp_path / "Dockerfile"
    df.write_text("FROM ray-sandbox/python AS base\nCOPY src /app/src\n"
                  "COPY --chown=0:0 req.txt /r.txt\nCOPY --from=base /etc/hosts /h\n"
                  "ADD https://example.com/x /x\n")
    monkeypatch.chdir(tmp_path)
    image = modal.Image.from_dockerfile(df).run_commands("echo built")
    assert image._recipe.text() == df.read_text() + "RUN echo built\n"
    assert sorted(f.ctx for f in image._recipe.files) == ["req.txt", "src"]
    with pytest.raises(NotImplementedError, match="build_args"):
        modal.Image.from_dockerfile(df, build_args={"A": "1"})
    df.write_text("FROM x\nCOPY ../outside /o\n")
    with pytest.raises(modal.exception.InvalidError, match="outside"):
        modal.Image.from_dockerfile(df)


def test_build_steps_refuse_what_they_cannot_honour():
    base = modal.Image.debian_slim()
    with pytest.raises(NotImplementedError, match="secrets="):
        base.pip_install("x", secrets=[modal.Secret.from_dict({"T": "s"})])
    with pytest.raises(NotImplementedError, match="gpu"):
        base.run_commands("nvidia-smi", gpu="T4")
    with pytest.raises(modal.exception.InvalidError, match="variable name"):
        base.env({"not a name": "1"})
    forced = base.run_commands("echo", force_build=True)
    assert forced._recipe.text() != base.run_commands("echo", force_build=True)._recipe.text()
    with pytest.raises(NotImplementedError, match="Image.from_aws_ecr"):
        modal.Image.from_aws_ecr("x")
    with pytest.raises(FileNotFoundError):
        base.add_local_file("/no/such/file", "/x")


def test_the_build_ca_is_trusted_by_run_steps_only():
    text = with_build_ca("FROM a\nRUN x\nFROM scratch\nCOPY --from=0 /y /y\n")
    assert text.splitlines()[:3] == ["FROM a", "COPY .rsb-build-ca.pem /tmp/.rsb-build-ca.pem",
                                     "ARG SSL_CERT_FILE=/tmp/.rsb-build-ca.pem"]
    assert "ENV" not in text  # build arguments: not the image's environment
    assert text.splitlines()[-2:] == ["FROM scratch", "COPY --from=0 /y /y"]  # no RUN there
    assert with_build_ca("FROM a\n").splitlines()[-1] == "RUN rm -f /tmp/.rsb-build-ca.pem"


def test_filesystem_errors_are_modals_and_ours():
    sid = "ab" * 16
    cases = {errors.SandboxFileNotFoundError("m", sandbox_id=sid):
             errors.ModalSandboxFilesystemNotFoundError,
             errors.SandboxIsADirectoryError("m"): errors.ModalSandboxFilesystemIsADirectoryError,
             errors.SandboxFileExistsError("m"):
             errors.ModalSandboxFilesystemPathAlreadyExistsError,
             errors.FileTooLargeError("m"): errors.ModalSandboxFilesystemFileTooLargeError,
             errors.SandboxFileError("m"): errors.ModalSandboxFilesystemError}
    for ours, theirs in cases.items():
        got = modal_error(ours)
        assert type(got) is theirs and got.message == "m" and isinstance(got, type(ours))
    full = errors.SandboxFileError("remove /d: Directory not empty")
    full.errno = 39
    assert type(modal_error(full)) is errors.ModalSandboxFilesystemDirectoryNotEmptyError


def test_snapshot_ids_carry_the_snapshot():
    snap = Snapshot(snapshot_id="cd" * 16, source_id="ab" * 16, node_id="n1", path="/p",
                    config={}, image="ray-sandbox/python", image_digest="sha256:" + "0" * 64,
                    network="public", overlay=True, platform="linux/amd64", rootless=False,
                    source_dir="/s")
    sid = modal.SandboxSnapshot(snap).object_id
    assert sid.startswith("rsnap-")
    assert modal.SandboxSnapshot.from_id(sid)._snapshot == snap
    with pytest.raises(modal.exception.NotFoundError):
        modal.SandboxSnapshot.from_id("sn-nope")


def test_enable_output_shows_builds_only_inside(capsys):
    output.show("before")
    with modal.enable_output():
        with modal.enable_output():
            output.show("inside")
        output.show("still")
    output.show("after")
    assert capsys.readouterr().err == "inside\nstill\n"


def test_secret_from_dotenv(tmp_path):
    (tmp_path / ".env").write_text("# c\nA=1\nexport B='two words'\nC=\"q\" \nD=x # note\n")
    assert modal.Secret.from_dotenv(tmp_path).env == {"A": "1", "B": "two words", "C": "q",
                                                      "D": "x"}
    with pytest.raises(modal.exception.NotFoundError):
        modal.Secret.from_dotenv(tmp_path / "none")


def test_platform_names_are_refused_and_others_missing():
    for name in ("Function", "Queue", "Cls", "web_endpoint"):
        with pytest.raises(NotImplementedError, match=f"modal.{name}"):
            getattr(modal, name)
    with pytest.raises(AttributeError):
        _ = modal.NoSuchThing
    with pytest.raises(NotImplementedError, match="raw_registry_image"):
        _ = modal.experimental.raw_registry_image
    with pytest.raises(NotImplementedError, match="replace_bytes"):
        modal.file_io.replace_bytes(None, b"")
    assert modal.container_process.ContainerProcess is modal.ContainerProcess
    assert modal.stream_type.StreamType.STDOUT is modal.StreamType.STDOUT
    assert modal.io_streams.StreamReader is modal.StreamReader
    assert modal.output.enable_output is modal.enable_output
    assert modal.image.Image is modal.Image


# --- docs/compat.md's Modal tables against the facade's names (issue 33) -----------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "compat.md"
CLASSES = {c.__name__: c for c in (
    modal.App, modal.Image, modal.Secret, modal.Volume, modal.Sandbox, modal.SandboxSnapshot,
    modal.SandboxFilesystem, modal.ContainerProcess, modal.StreamReader, modal.StreamWriter,
    modal.StreamType, modal.FileIO, modal.Tunnel, modal.Probe)}
SUBMODULES = ("exception", "container_process", "stream_type", "io_streams", "image",
              "snapshot", "types", "file_io", "experimental", "output")
KWARGS = {"Sandbox.create": set(UNSUPPORTED), "Sandbox.exec": {"pty", "pty_info", "_pty_info"}}
STATUSES = ("supported", "different", "ours", "refused")
_CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")


def _public(name: str) -> bool:
    return not name.startswith("_") or name.startswith("_experimental")


def _instance_attrs(cls: type) -> set[str]:
    """The public attributes ``__init__`` sets (``self.x = ...``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (TypeError, OSError):
        return set()
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and _public(n.attr)}


def _members(cls: type) -> set[str]:
    if issubclass(cls, enum.Enum):
        return set(cls.__members__)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return {n for n in vars(cls) if _public(n)} | fields | _instance_attrs(cls)


def facade_names() -> dict[str, bool]:
    """Every public name of the facade -> whether it is refused as a whole."""
    out: dict[str, bool] = {}
    for name in [*modal.__all__, *modal.PLATFORM, "OutboundPolicy"]:
        out[f"modal.{name}"] = name in modal.PLATFORM or name == "OutboundPolicy"
    for sub in SUBMODULES:
        mod = getattr(modal, sub)
        for name in getattr(mod, "__all__", ()):
            out[f"modal.{sub}.{name}"] = is_refused(getattr(mod, name))
    for extra in ("raw_registry_image", "OutboundPolicy"):  # refused by the module
        out[f"modal.experimental.{extra}"] = True
    for cname, cls in CLASSES.items():
        for member in _members(cls):
            attr = inspect.getattr_static(cls, member, None)
            out[f"{cname}.{member}"] = attr is not None and is_refused(attr)
    for call, refused_keys in KWARGS.items():
        cname, method = call.split(".")
        params = inspect.signature(getattr(CLASSES[cname], method)).parameters.values()
        keys = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.name != "self"} | refused_keys
        out.update({f"{call}({k}=)": k in refused_keys for k in keys})
    return out


def documented_names() -> dict[str, str]:
    """Every name in the first column of docs/compat.md's Modal tables -> its status."""
    section = DOC.read_text().split("## Modal:", 1)[1]
    out: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3 and cells[1] in STATUSES, line
        for token in re.findall(r"`([^`]+)`", cells[0]):
            m = _CALL.match(token)
            names = [token] if m is None else [
                f"{m[1]}({kw.strip().rstrip('=')}=)" for kw in m[2].split(",") if kw.strip()]
            for name in names:
                assert name not in out, f"{name} is in two rows"
                out[name] = cells[1]
            if m is not None:  # its options' rows document the call itself: the first says
                out.setdefault(m[1], cells[1])
    return out


def test_compat_md_lists_exactly_the_facades_names():
    facade, doc = facade_names(), documented_names()
    assert sorted(set(doc) - set(facade)) == [], "documented, but not in the facade"
    assert sorted(set(facade) - set(doc)) == [], "in the facade, but not documented"
    wrong = sorted(n for n, refused_ in facade.items() if refused_ != (doc[n] == "refused"))
    assert wrong == [], "marked refused in docs/compat.md but not refused (or the reverse)"


def test_the_refused_names_refuse_naming_themselves():
    for name, refused_ in facade_names().items():
        if not refused_ or "(" in name:
            continue
        head, _, attr = name.rpartition(".")
        with pytest.raises(NotImplementedError, match=re.escape(attr)):
            if head in CLASSES:
                value = getattr(CLASSES[head], attr)  # a refused class attribute raises here
                (value.fget if isinstance(value, property) else value)(None)
            else:
                value = modal
                for part in name.split(".")[1:]:
                    value = getattr(value, part)
                value()


# What Modal's sandbox guide and its 13_sandboxes examples call (/work/notes/facade_gaps.md's
# tables, read from modal.com/docs/guide/sandbox* and modal-labs/modal-examples) and every
# create() option of Modal 1.6.4: each is a name of the facade, working or refused.
GUIDE_AND_EXAMPLES = {
    "modal.App", "modal.Sandbox", "modal.Image", "modal.Secret", "modal.Volume", "modal.Tunnel",
    "modal.Probe", "modal.SandboxSnapshot", "modal.enable_output", "modal.exception",
    "modal.container_process.ContainerProcess", "modal.stream_type.StreamType",
    "modal.io_streams.StreamReader", "modal.io_streams.StreamWriter", "modal.types.FileInfo",
    "modal.types.FileType", "modal.types.FileWatchEventType", "modal.types.FileWatchEvent",
    "modal.types.SandboxConnectCredentials", "modal.output.enable_output",
    "modal.image.Image", "modal.snapshot.SandboxSnapshot", "modal.file_io.replace_bytes",
    "modal.file_io.delete_bytes", "modal.file_io.FileWatchEventType",
    "modal.experimental.raw_registry_image", "modal.experimental.image_delete",
    "modal.OutboundPolicy", "modal.exception.NotFoundError", "modal.exception.AlreadyExistsError",
    "modal.Function", "modal.Cls", "modal.Queue", "modal.Dict", "modal.Period", "modal.Server",
    "modal.Workspace", "modal.Retries", "modal.concurrent", "modal.fastapi_endpoint",
    "modal.web_endpoint", "modal.asgi_app", "modal.web_server", "modal.enter", "modal.method",
    "modal.parameter", "modal.forward",
    "App.lookup", "App.app_id", "App.get_dashboard_url", "App.function", "App.deploy",
    "App.run", "App.local_entrypoint", "App.cls",
    "Image.from_registry", "Image.debian_slim", "Image.apt_install", "Image.pip_install",
    "Image.uv_pip_install", "Image.run_commands", "Image.env", "Image.workdir",
    "Image.entrypoint", "Image.add_local_file", "Image.add_local_dir", "Image.build",
    "Image.imports", "Image.from_id", "Image.from_scratch", "Image.from_dockerfile",
    "Image.from_name", "Image.micromamba", "Image.from_aws_ecr",
    "Image.from_gcp_artifact_registry", "Image.object_id",
    "Secret.from_dict", "Secret.from_local_environ", "Secret.from_name", "Secret.from_dotenv",
    "Secret.objects",
    "Volume.from_name", "Volume.ephemeral", "Volume.read_file", "Volume.batch_upload",
    "Volume.listdir", "Volume.iterdir", "Volume.remove_file", "Volume.copy_files",
    "Volume.read_only", "Volume.with_mount_options", "Volume.commit", "Volume.reload",
    "Volume.delete",
    "Sandbox.from_id", "Sandbox.from_name", "Sandbox.list", "Sandbox._experimental_from_snapshot",
    "Sandbox.object_id", "Sandbox.exec", "Sandbox.stdout", "Sandbox.stderr", "Sandbox.stdin",
    "Sandbox.wait", "Sandbox.poll", "Sandbox.returncode", "Sandbox.terminate", "Sandbox.detach",
    "Sandbox.tunnels", "Sandbox.create_connect_token", "Sandbox.get_tags", "Sandbox.set_tags",
    "Sandbox.snapshot_filesystem", "Sandbox.snapshot_directory", "Sandbox.mount_image",
    "Sandbox.unmount_image", "Sandbox._experimental_snapshot", "Sandbox.wait_until_ready",
    "Sandbox.filesystem", "Sandbox.reload_volumes", "Sandbox.logs", "Sandbox.get_dashboard_url",
    "Sandbox.hydrate", "Sandbox._experimental_sidecars", "Sandbox.open", "Sandbox.ls",
    "Sandbox.mkdir", "Sandbox.rm", "Sandbox.watch",
    "Sandbox._experimental_set_outbound_network_policy",
    "Tunnel.url", "Tunnel.tls_socket", "Tunnel.tcp_socket", "Tunnel.host", "Tunnel.port",
    "Tunnel.unencrypted_host", "Tunnel.unencrypted_port",
    "StreamType.PIPE", "StreamType.DEVNULL", "StreamType.STDOUT", "ContainerProcess.stdout",
    "ContainerProcess.stderr", "ContainerProcess.stdin", "ContainerProcess.wait",
    "ContainerProcess.poll", "ContainerProcess.returncode", "ContainerProcess.attach",
    "StreamReader.read", "StreamReader.close", "StreamReader.aclose",
    "StreamReader.file_descriptor", "StreamWriter.write", "StreamWriter.write_eof",
    "StreamWriter.drain",
    "SandboxFilesystem.read_bytes", "SandboxFilesystem.read_text",
    "SandboxFilesystem.write_bytes", "SandboxFilesystem.write_text",
    "SandboxFilesystem.list_files", "SandboxFilesystem.stat", "SandboxFilesystem.make_directory",
    "SandboxFilesystem.remove", "SandboxFilesystem.copy_from_local",
    "SandboxFilesystem.copy_to_local", "SandboxFilesystem.watch",
    "Probe.with_exec", "Probe.with_tcp", "Probe.interval_ms", "Probe.tcp_port", "Probe.exec_argv",
    "SandboxSnapshot.from_id", "SandboxSnapshot.object_id",
    "FileIO.read", "FileIO.readline", "FileIO.readlines", "FileIO.write", "FileIO.flush",
    "FileIO.seek", "FileIO.close",
    *(f"Sandbox.create({k}=)" for k in (
        "app", "name", "tags", "image", "env", "secrets", "network_file_systems", "timeout",
        "idle_timeout", "workdir", "gpu", "cloud", "region", "cpu", "memory", "runtime",
        "block_network", "outbound_cidr_allowlist", "outbound_domain_allowlist",
        "_experimental_outbound_policy", "inbound_cidr_allowlist", "volumes", "pty",
        "encrypted_ports", "h2_ports", "unencrypted_ports", "custom_domain", "proxy",
        "include_oidc_identity_token", "readiness_probe", "verbose", "experimental_options",
        "_experimental_enable_snapshot", "_experimental_persistent", "client",
        "environment_name", "pty_info", "cidr_allowlist")),
    *(f"Sandbox.exec({k}=)" for k in ("stdout", "stderr", "timeout", "workdir", "env",
                                       "secrets", "text", "bufsize", "pty", "pty_info")),
}


def test_every_name_of_modals_guide_and_examples_is_here():
    assert sorted(GUIDE_AND_EXAMPLES - set(facade_names())) == []
    statuses = documented_names()
    counts = {s: sum(1 for n in GUIDE_AND_EXAMPLES if statuses[n] == s) for s in STATUSES}
    assert sum(counts.values()) == len(GUIDE_AND_EXAMPLES)
    assert counts["refused"] < counts["supported"] + counts["different"]
