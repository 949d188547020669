"""Image reference parsing and small pure helpers (no processes, no files)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ray_sandbox.runtime.errors import ConfigError, ImageReferenceError
from ray_sandbox.runtime.images import (
    ImageConfig,
    Platform,
    Transport,
    is_loopback,
    parse_reference,
)

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("python", "docker://docker.io/library/python:latest"),
        ("python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
        ("docker://python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
        ("library/python:3", "docker://docker.io/library/python:3"),
        ("index.docker.io/library/python", "docker://docker.io/library/python:latest"),
        ("ghcr.io/org/team/app:v1", "docker://ghcr.io/org/team/app:v1"),
        ("localhost/app", "localhost/app:latest"),  # built on this node (podman's name)
        ("docker://localhost/app", "docker://localhost/app:latest"),
        ("localhost:5000/x", "docker://localhost:5000/x:latest"),
        ("127.0.0.1:15000/lab/x:v2", "docker://127.0.0.1:15000/lab/x:v2"),
        ("[::1]:5000/x:t", "docker://[::1]:5000/x:t"),
        ("my-reg.example.com:443/a_b/c__d/e-f.g:T_1.2-3", "docker://my-reg.example.com:443/a_b/c__d/e-f.g:T_1.2-3"),  # noqa: E501
        (f"python@{DIGEST}", f"docker://docker.io/library/python@{DIGEST}"),
        (f"python:3.12@{DIGEST}", f"docker://docker.io/library/python:3.12@{DIGEST}"),
        ("docker:dind", "docker://docker.io/library/docker:dind"),
        ("docker://oci:latest", "docker://docker.io/library/oci:latest"),
        ("ray-sandbox/python", "ray-sandbox/python:latest"),
        ("ray-sandbox/busybox:latest", "ray-sandbox/busybox:latest"),
        ("docker://ray-sandbox/python", "docker://docker.io/ray-sandbox/python:latest"),
        ("oci:/srv/layout:v1", "oci:/srv/layout:v1"),
        ("oci:/srv/layout", "oci:/srv/layout"),
        ("oci-archive:/a/b.tar", "oci-archive:/a/b.tar"),
        ("oci-archive:/a/b.tar:tag", "oci-archive:/a/b.tar:tag"),
        ("docker-archive:/a/b.tar", "docker-archive:/a/b.tar"),
        ("docker-archive:/a/b.tar:lab/x:v1", "docker-archive:/a/b.tar:lab/x:v1"),
        ("docker-archive:/a/b.tar:@1", "docker-archive:/a/b.tar:@1"),
        ("dir:/a/b", "dir:/a/b"),
    ],
)
def test_normalizes(text: str, normalized: str) -> None:
    ref = parse_reference(text)
    assert str(ref) == normalized
    assert parse_reference(str(ref)) == ref  # normalization is a fixed point


def test_parts_and_skopeo_source() -> None:
    ref = parse_reference(f"127.0.0.1:5000/lab/x:v1@{DIGEST}")
    assert (ref.transport, ref.registry, ref.repository, ref.tag, ref.digest, ref.host) == (
        Transport.DOCKER, "127.0.0.1:5000", "lab/x", "v1", DIGEST, "127.0.0.1")
    assert ref.source == f"docker://127.0.0.1:5000/lab/x@{DIGEST}"  # skopeo refuses tag+digest
    assert parse_reference("[::1]:5000/x").host == "::1"
    assert parse_reference("python").source == "docker://docker.io/library/python:latest"
    local = parse_reference("ray-sandbox/python")
    assert (local.transport, local.repository, local.tag) == (
        Transport.LOCAL, "ray-sandbox/python", "latest")


def test_relative_paths_become_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/tmp")
    assert str(parse_reference("oci:layout:t")) == "oci:/tmp/layout:t"


@pytest.mark.parametrize(
    "text",
    [
        "", "   ", "Python", "python:", "python::1", "python:bad tag", "-python", "python/",
        "a//b", "python@sha256:123", f"python@sha512:{'a' * 128}", f"python@{DIGEST.upper()}",
        "http://python", "docker://", "ftp://x/y", "oci:", "oci::tag",
        "oci:/x:bad/tag", "dir:/x:tag", "docker-archive:/x:Bad/Ref", f"ray-sandbox/python@{DIGEST}",
        "a" * 256, "python:" + "t" * 129, "Docker.io/Library/python",
    ],
)
def test_rejects(text: str) -> None:
    with pytest.raises(ImageReferenceError):
        parse_reference(text)


def test_rejects_non_strings() -> None:
    with pytest.raises(ImageReferenceError):
        parse_reference(None)  # type: ignore[arg-type]


_component = st.from_regex(r"[a-z0-9]{1,5}([._-][a-z0-9]{1,5}){0,2}", fullmatch=True)
_tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@settings(database=None)  # leave no .hypothesis/ behind
@given(
    registry=st.sampled_from(["", "localhost:5000/", "127.0.0.1:15000/", "reg.example.com/"]),
    path=st.lists(_component, min_size=1, max_size=3),
    tag=st.one_of(st.none(), _tag),
    digest=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(
        lambda b: f"sha256:{b.hex()}")),
)
def test_docker_refs_round_trip(registry: str, path: list[str], tag: str | None,
                                digest: str | None) -> None:
    assume(registry or "." not in path[0])  # "a.b/c" names the registry a.b, by design
    text = registry + "/".join(path) + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse_reference(text)
    assert parse_reference(str(ref)) == ref
    assert ref.digest == digest
    assert ref.tag == (tag or (None if digest else "latest"))
    assert ref.repository.endswith("/".join(path))


@settings(database=None)
@given(st.text(max_size=40))
def test_never_crashes_on_garbage(text: str) -> None:
    try:
        parse_reference(text)
    except ImageReferenceError:
        pass


def test_platform_parse_and_match() -> None:
    assert str(Platform.parse("linux/arm64")) == "linux/arm64"
    assert Platform.parse("linux/x86_64").architecture == "amd64"
    arm7 = Platform.parse("linux/arm/v7")
    assert arm7.matches("linux", "arm", "v7") and not arm7.matches("linux", "arm", "v6")
    assert arm7.matches("linux", "arm", None)
    assert not Platform.parse("linux/amd64").matches("linux", "arm64", None)
    assert Platform().os == "linux" and Platform().architecture  # host default
    for bad in ("linux", "linux/", "/amd64", "a/b/c/d"):
        with pytest.raises(ConfigError):
            Platform.parse(bad)


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.9.8.7", "::1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "example.com", "localhost.example.com"]))


def test_image_config_from_oci_json() -> None:
    blob = {
        "architecture": "arm64", "os": "linux", "variant": "v8",
        "config": {"Env": ["PATH=/bin", "A=b=c"], "WorkingDir": "/app", "User": "1000:1000",
                   "Entrypoint": ["/init"], "Cmd": None, "StopSignal": "SIGINT",
                   "Labels": {"k": "v"}},
    }
    cfg = ImageConfig.from_oci(blob)
    assert (cfg.env, cfg.working_dir, cfg.user, cfg.entrypoint, cfg.cmd, cfg.stop_signal) == (
        ["PATH=/bin", "A=b=c"], "/app", "1000:1000", ["/init"], [], "SIGINT")
    assert (cfg.architecture, cfg.os, cfg.variant, cfg.labels) == ("arm64", "linux", "v8",
                                                                    {"k": "v"})
    assert cfg.env_map == {"PATH": "/bin", "A": "b=c"}
    assert ImageConfig.from_oci({"architecture": "amd64", "os": "linux"}).cmd == []
