"""Modal's ``Volume`` as far as sandboxes use it: a named ray_sandbox volume
(``ray_sandbox.actor.volumes``, docs/volumes.md) that ``Sandbox.create(volumes=...)`` mounts.

A volume lives on one node and its sandboxes are placed there. Writes are visible to the
next sandbox at once, so ``commit``/``reload`` have nothing to do. A volume has a size here
(Modal's grow): ``from_name(..., create_if_missing=True)`` makes one of
``RAY_SANDBOX_MODAL_VOLUME_SIZE`` (default 4Gi, a sparse file: only what is written takes
disk)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..actor import volumes
from ..runtime.errors import (
    ConfigError,
    ModalError,
    ModalInvalidError,
    ModalNotFoundError,
    VolumeExistsError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from ._aio import static
from ._options import refuse
from ._refuse import refused

DEFAULT_SIZE = "4Gi"


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
    listdir = refused("Volume.listdir", _USE_A_SANDBOX)
    iterdir = refused("Volume.iterdir", _USE_A_SANDBOX)
    read_file = refused("Volume.read_file", _USE_A_SANDBOX)
    read_file_into_fileobj = refused("Volume.read_file_into_fileobj", _USE_A_SANDBOX)
    remove_file = refused("Volume.remove_file", _USE_A_SANDBOX)
    batch_upload = refused("Volume.batch_upload", _USE_A_SANDBOX)
    copy_files = refused("Volume.copy_files", _USE_A_SANDBOX)
    read_only = refused("Volume.read_only", "volumes are mounted read-write here")
    with_mount_options = refused("Volume.with_mount_options", "volumes are mounted whole "
                                 "and read-write here")
