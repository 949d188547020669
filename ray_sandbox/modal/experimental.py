"""Modal's ``modal.experimental``, as far as sandboxes use it: ``image_delete`` (delete an
image that ``snapshot_filesystem`` or a DSL build made). Its other names concern Modal's
Functions and clusters and are refused by name."""

from __future__ import annotations

from typing import Any

from .. import actor
from ._refuse import refusal


def image_delete(image_id: str, *, client: Any = None, environment_name: str | None = None
                 ) -> None:
    """Delete the filesystem image ``image_id`` (an ``Image.object_id``) from its node and
    every node that fetched it (``ray_sandbox.delete_filesystem_image``); ImageInUseError
    while a sandbox runs from it."""
    if client is not None or environment_name is not None:
        raise refusal("modal.experimental.image_delete(client=, environment_name=)",
                      "there is no Modal client or environment here")
    actor.delete_filesystem_image(image_id)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise refusal(f"modal.experimental.{name}", "Modal's experimental platform API; "
                  "ray_sandbox.modal has its sandboxes (and image_delete)")


__all__ = ["image_delete"]
