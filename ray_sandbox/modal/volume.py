"""Modal's ``Volume`` as far as sandboxes use it: a named ray_sandbox volume
(``ray_sandbox.actor.volumes``, docs/volumes.md) that ``Sandbox.create(volumes=...)`` mounts.

A volume lives on one node and its sandboxes are placed there. Writes are visible to the
next sandbox at once, so ``commit``/``reload`` have nothing to do. A volume has a size here
(Modal's grow): ``from_name(..., create_if_missing=True)`` makes one of
``RAY_SANDBOX_MODAL_VOLUME_SIZE`` (default 4Gi, a sparse file: only what is written takes
disk)."""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import ray

from .. import actor
from ..actor import volumes
from ..runtime.errors import (
    ConfigError,
    ModalError,
    ModalInvalidError,
    ModalNotFoundError,
    SandboxFileNotFoundError,
    VolumeExistsError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from ._aio import dual, static
from ._options import refuse
from ._refuse import refused

DEFAULT_SIZE = "4Gi"
_HELPER_IMAGE = "ray-sandbox/busybox"  # what reads a volume for read_file
_HELPER_CPU = 0.1
_HELPER_MEMORY = "64Mi"
_CHUNK = 1 << 20


class _BatchUpload:
    """What ``Volume.batch_upload()`` yields: files and directories staged for the volume."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._count = 0

    def _target(self, remote_path: str) -> Path:
        rel = posixpath.normpath("/" + str(remote_path)).lstrip("/")
        if not rel or self._root is None:
            raise ModalInvalidError(f"not a path in the volume: {remote_path!r}")
        target = self._root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        self._count += 1
        return target

    def put_file(self, local_file: str | os.PathLike[str] | BinaryIO, remote_path: str,
                 mode: int | None = None) -> None:
        """A local file (a path, or a binary file object such as ``io.BytesIO``)."""
        target = self._target(remote_path)
        if isinstance(local_file, str | os.PathLike):
            shutil.copyfile(local_file, target)
        else:
            with open(target, "wb") as out:
                shutil.copyfileobj(local_file, out)
        if mode is not None:
            target.chmod(mode & 0o777)

    def put_directory(self, local_path: str | os.PathLike[str], remote_path: str,
                      recursive: bool = True) -> None:
        """A local directory's files (with ``recursive``, its subdirectories' too)."""
        target = self._target(remote_path)
        if recursive:
            shutil.copytree(local_path, target, symlinks=True, dirs_exist_ok=True)
            return
        target.mkdir(exist_ok=True)
        for entry in Path(local_path).iterdir():
            if entry.is_file():
                shutil.copyfile(entry, target / entry.name)


class Volume:
    """A named volume (``object_id`` is its name)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.object_id = name

    def __repr__(self) -> str:
        return f"Volume({self.name!r})"

    @static
    def from_name(name: str, *, create_if_missing: bool = False,
                  environment_name: str | None = None, version: Any = None,
                  client: Any = None) -> Volume:
        """The volume ``name``; with ``create_if_missing`` it is made on this node if no
        node has it (ModalNotFoundError otherwise)."""
        refuse({"environment_name": environment_name, "version": version, "client": client},
               "Volume.from_name")
        if any(v.name == name for v in volumes.list_volumes()):
            return Volume(name)
        if not create_if_missing:
            raise ModalNotFoundError(f"no volume {name!r}")
        try:
            volumes.create_volume(name, os.environ.get("RAY_SANDBOX_MODAL_VOLUME_SIZE",
                                                       DEFAULT_SIZE))
        except VolumeExistsError:
            pass  # made meanwhile by another caller: fine
        except ConfigError as exc:
            raise ModalInvalidError(exc.message) from None
        return Volume(name)

    @staticmethod
    @contextmanager
    def ephemeral(**options: Any) -> Iterator[Volume]:
        """A volume that exists for the block (deleted at its end)."""
        refuse(options, "Volume.ephemeral")
        name = f"ephemeral-{uuid.uuid4().hex[:16]}"
        volumes.create_volume(name, os.environ.get("RAY_SANDBOX_MODAL_VOLUME_SIZE",
                                                   DEFAULT_SIZE))
        try:
            yield Volume(name)
        finally:
            volumes.delete_volume(name)

    @static
    def delete(name: str, **options: Any) -> None:
        """Delete the volume and its data (refused while a sandbox has it mounted)."""
        refuse(options, "Volume.delete")
        try:
            volumes.delete_volume(name)
        except VolumeNotFoundError:
            raise ModalNotFoundError(f"no volume {name!r}") from None
        except VolumeInUseError as exc:
            raise ModalError(exc.message, sandbox_id=exc.sandbox_id) from None

    def commit(self) -> None:
        """Nothing to do: a sandbox's writes are on the volume's node at once."""

    def reload(self) -> None:
        """Nothing to do: the next sandbox sees what earlier ones wrote."""

    _USE_A_SANDBOX = ("read and write the volume from a sandbox that mounts it "
                      "(Sandbox.create(volumes={path: vol}))")
    @dual
    def read_file(self, path: str) -> Iterator[bytes]:
        """The file's bytes (up to 64 MiB), in chunks: read by a short-lived sandbox on the
        volume's node that mounts it (so it waits while another sandbox has it mounted
        read-write, up to the mount's wait)."""
        rel = posixpath.normpath("/" + path).lstrip("/")
        helper: Any = actor.create(image=_HELPER_IMAGE, volumes={"/v": self.name}, network="none",
                              cpu=_HELPER_CPU, memory=_HELPER_MEMORY)
        try:
            data: bytes = ray.get(helper.read_file.remote(f"/v/{rel}"))
        except SandboxFileNotFoundError:
            raise ModalNotFoundError(f"no file {path!r} in volume {self.name!r}") from None
        finally:
            ray.get(helper.terminate.remote())
        return iter([data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""])

    @contextmanager
    def batch_upload(self, force: bool = False) -> Iterator[_BatchUpload]:
        """``put_file``/``put_directory`` calls collected in the block, written into the
        volume at its end in one go (``ray_sandbox.fill_volume``). Files already there are
        replaced whatever ``force`` says."""
        batch = _BatchUpload()
        with tempfile.TemporaryDirectory(prefix="rsb-modal-upload-") as tmp:
            batch._root = Path(tmp)
            yield batch
            if batch._count:
                volumes.fill_volume(self.name, tmp)

    listdir = refused("Volume.listdir", _USE_A_SANDBOX)
    iterdir = refused("Volume.iterdir", _USE_A_SANDBOX)
    read_file_into_fileobj = refused("Volume.read_file_into_fileobj", _USE_A_SANDBOX)
    remove_file = refused("Volume.remove_file", _USE_A_SANDBOX)
    copy_files = refused("Volume.copy_files", _USE_A_SANDBOX)
    read_only = refused("Volume.read_only", "volumes are mounted read-write here")
    with_mount_options = refused("Volume.with_mount_options", "volumes are mounted whole "
                                 "and read-write here")
