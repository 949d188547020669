"""The offline Python images in real sandboxes (docs/images.md, "Offline images"): what Modal's
and Ray's examples call (``python -c``, ``pip install``, ``python -m venv``) works in
``ray-sandbox/python``; pip installs files from the sandbox's own filesystem without any
network; ``ray-sandbox/python:3.13`` and Modal's ``Image.debian_slim(python_version=)``."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

import ray_sandbox.modal as modal
from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.errors import ImageNotFoundError, ModalInvalidError
from ray_sandbox.runtime.images import ImageStore, PullPolicy, store
from tests.fx_hostile import HEAVY, heavy
from tests.fx_runtime import leftovers

CLI = str(Path(sys.executable).parent / "ray-sandbox")


def ok(rt: SandboxRuntime, sid: str, command: str) -> str:
    res = rt.exec(sid, command, timeout=120)
    assert res.exit_code == 0, (command, res.exit_code, res.stdout, res.stderr)
    return res.stdout


@pytest.fixture(scope="module")
def writable(runtime: SandboxRuntime):
    """A ray-sandbox/python sandbox with a writable root and no network at all."""
    sid = runtime.create(image="ray-sandbox/python", readonly=False, memory="512Mi",
                         network="none")
    yield sid
    runtime.delete(sid)


def test_python_pip_and_venv_are_there(runtime: SandboxRuntime, writable: str):
    assert ok(runtime, writable, "python -c 'import sys; print(sys.version_info[:2])'") == \
        "(3, 11)\n"
    assert ok(runtime, writable, "for c in python pip pip3; do command -v $c; done").split() == [
        "/usr/bin/python", "/usr/bin/pip", "/usr/bin/pip3"]
    assert " (python 3.11)" in ok(runtime, writable, "pip --version")
    assert ok(runtime, writable, "python -m venv /tmp/venv && "
                                 "/tmp/venv/bin/python -c 'import sys; print(sys.prefix)'"
              ) == "/tmp/venv\n"
    assert "/tmp/venv/lib/python3.11" in ok(runtime, writable, "/tmp/venv/bin/pip --version")


def tiny_wheel(name: str, value: str) -> tuple[str, bytes]:
    """A pure-Python wheel built here, by hand: (file name, bytes)."""
    files = {f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
             f"{name}-0.1.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{name}-0.1.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n"}
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"  # noqa: E501
        for path, data in files.items()) + f"{name}-0.1.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as wheel:
        for path, data in {**files, f"{name}-0.1.dist-info/RECORD": record.encode()}.items():
            wheel.writestr(path, data)
    return f"{name}-0.1-py3-none-any.whl", buf.getvalue()


def tiny_sdist(name: str, value: str) -> tuple[str, bytes]:
    """A pure-Python sdist with a setuptools pyproject.toml: (file name, bytes)."""
    files = {"pyproject.toml": (f'[build-system]\nrequires = ["setuptools"]\n'
                                f'build-backend = "setuptools.build_meta"\n\n'
                                f'[project]\nname = "{name}"\nversion = "0.1"\n'),
             f"{name}.py": f"VALUE = {value!r}\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in files.items():
            info = tarfile.TarInfo(f"{name}-0.1/{path}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return f"{name}-0.1.tar.gz", buf.getvalue()


def test_pip_installs_files_without_network(runtime: SandboxRuntime, writable: str):
    """Plain ``pip install`` as in a python:3.x-slim image (no PEP 668 refusal), offline: a
    wheel as it is, an sdist with the image's own setuptools (``--no-build-isolation``:
    isolation would fetch setuptools from an index)."""
    token = os.urandom(4).hex()
    wheel, wheel_bytes = tiny_wheel("rsbtinywheel", token)
    sdist, sdist_bytes = tiny_sdist("rsbtinysdist", token)
    runtime.write_file(writable, f"/tmp/{wheel}", wheel_bytes)
    runtime.write_file(writable, f"/tmp/{sdist}", sdist_bytes)
    ok(runtime, writable, f"pip install /tmp/{wheel}")
    ok(runtime, writable, f"pip install --no-build-isolation /tmp/{sdist}")
    assert ok(runtime, writable, "cd / && python -c 'import rsbtinywheel, rsbtinysdist; "
                                 "print(rsbtinywheel.VALUE, rsbtinysdist.VALUE)'"
              ).split() == [token, token]
    # into /usr/local, like Debian's pip for anything it did not install itself
    assert "/usr/local/lib/python3.11/dist-packages" in ok(
        runtime, writable, "python -c 'import rsbtinywheel; print(rsbtinywheel.__file__)'")


def test_cli_runs_python(tmp_path: Path, image_store: ImageStore, default_image):
    """``ray-sandbox run -- python -c ...`` with the default image (it printed 127)."""
    env = {**os.environ, "RAY_SANDBOX_HOME": str(tmp_path),
           "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.run([CLI, "run", "--", "python", "-c", "print(6 * 7)"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, "42"), proc.stderr
    assert leftovers(tmp_path) == {}


def test_311_is_latest(image_store: ImageStore, default_image):
    """``ray-sandbox/python:3.11`` is the image ``latest`` names: one build, one digest."""
    assert image_store.get("ray-sandbox/python:3.11").digest == default_image.digest


def test_modal_debian_slim_maps_python_versions():
    assert modal.Image.debian_slim().ref == "ray-sandbox/python"
    assert modal.Image.debian_slim(python_version="3.11").ref == "ray-sandbox/python:3.11"
    assert modal.Image.debian_slim(python_version="3.13").ref == "ray-sandbox/python:3.13"
    for asked, served in (("3.12", "3.13"), ("3.10", "3.11"), ("3.14", "3.13")):
        with pytest.warns(UserWarning, match=f"Python {served}"):
            image = modal.Image.debian_slim(python_version=asked)
        assert image.ref == f"ray-sandbox/python:{served}"
    for far in ("3.8", "2.7", "3.16", "3", "python3.12", "3.12.1.1", ""):
        with pytest.raises(ModalInvalidError, match="3.11, 3.13"):
            modal.Image.debian_slim(python_version=far)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert modal.Image.debian_slim(python_version="3.13.1").ref == "ray-sandbox/python:3.13"


def python313_cached(image_store: ImageStore) -> bool:
    """The 3.13 image is in the node store and current (no mmdebstrap run needed)."""
    try:
        image_store.get("ray-sandbox/python:3.13", policy=PullPolicy.NEVER)
    except ImageNotFoundError:
        return False
    return True


@heavy  # 10 s in CI; the 3.11 image's test stays
def test_python_313_sandbox(runtime: SandboxRuntime, image_store: ImageStore):
    """Modal's ``debian_slim(python_version="3.13")`` gives Python 3.13 with pip and venv.
    Builds the image (~30-60 s, Debian trixie) unless the node has it: heavy then."""
    if not HEAVY and not python313_cached(image_store):
        pytest.skip("heavy unless ray-sandbox/python:3.13 is built: set RAY_SANDBOX_HEAVY=1 "
                    "or run `ray-sandbox image build python:3.13`")
    image = modal.Image.debian_slim(python_version="3.13")
    assert image.ref in store.LOCAL_IMAGES
    sid = runtime.create(image=image.ref, readonly=False, memory="512Mi")
    try:
        assert ok(runtime, sid, "python -c 'import sys; print(sys.version_info[:2])'") == \
            "(3, 13)\n"
        assert " (python 3.13)" in ok(runtime, sid, "pip --version")
        wheel, data = tiny_wheel("rsbtiny313", "ok")
        runtime.write_file(sid, f"/tmp/{wheel}", data)
        ok(runtime, sid, f"python -m venv /tmp/v && pip install /tmp/{wheel} && "
                         "/tmp/v/bin/pip install /tmp/{wheel} && "
                         "/tmp/v/bin/python -c 'import rsbtiny313'".replace("{wheel}", wheel))
    finally:
        runtime.delete(sid)
