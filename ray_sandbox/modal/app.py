"""Modal's ``App``, ``Image`` and ``Secret``, as far as sandboxes use them: an App is a
name its sandboxes are labelled with, an Image an image reference, a Secret environment
variables."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime.errors import ModalInvalidError, ModalNotFoundError
from ..runtime.image_builders import PYTHON_IMAGES
from ._aio import static
from ._options import DEFAULT_IMAGE, refuse


class App:
    """A name for a group of sandboxes (``Sandbox.list(app_id=app.app_id)``). There is no
    app registry: every name exists."""

    def __init__(self, name: str | None = None, **options: Any) -> None:
        refuse(options, "App")  # image=, secrets=, volumes=: functions, not sandboxes
        self.name = name
        self.app_id = name

    def __repr__(self) -> str:
        return f"App({self.name!r})"

    @static
    def lookup(name: str, *, create_if_missing: bool = False,  # noqa: ARG004 - always there
               environment_name: str | None = None, client: Any = None) -> App:
        refuse({"environment_name": environment_name, "client": client}, "App.lookup")
        return App(name)


class Image:
    """An image reference. Building images (``pip_install``, ``run_commands``, …) is not
    supported: build it from a Dockerfile (docs/docker.md, "Dockerfile builds") and use
    ``from_registry``."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self.object_id = ref

    def __repr__(self) -> str:
        return f"Image({self.ref!r})"

    @static
    def from_registry(tag: str, secret: Any = None, **options: Any) -> Image:
        """Any reference ray_sandbox pulls: a registry tag, ``oci:``, ``ray-sandbox/…``."""
        refuse({"secret": secret, **options}, "Image.from_registry")
        return Image(tag)

    @static
    def debian_slim(python_version: str | None = None, force_build: bool = False) -> Image:
        """``ray-sandbox/python``, built offline from Debian's packages: Python 3.11
        (bookworm) by default, ``ray-sandbox/python:<version>`` for a ``python_version``, the
        nearest offered one (a warning says so) within one minor version; a version further
        off raises ``InvalidError`` naming what is offered (docs/images.md)."""
        refuse({"force_build": force_build}, "Image.debian_slim")
        if python_version is None:
            return Image(DEFAULT_IMAGE)
        return Image(f"ray-sandbox/python:{_offered_python(python_version)}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise NotImplementedError(f"Image.{name}: image builds are not supported by "
                                  "ray_sandbox.modal; build the image from a Dockerfile "
                                  "(`ray-sandbox image build -t NAME`, docs/docker.md, "
                                  "'Dockerfile builds') and use "
                                  "Image.from_registry('localhost/NAME') (docs/compat.md)")


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def _offered_python(asked: str) -> str:
    """The offered Python (``"3.13"``) nearest to ``asked``: exact, else within one minor
    version (the newer on a tie, which runs what the older one runs), with a warning."""
    offered = sorted(PYTHON_IMAGES, key=_minor)
    listing = ", ".join(offered)
    m = re.fullmatch(r"3\.(\d{1,2})(?:\.\d{1,3})?", asked) if isinstance(asked, str) else None
    if m is None:
        raise ModalInvalidError(f"Image.debian_slim(python_version={asked!r}): not a Python 3 "
                                f"version like '3.13'; offered here: {listing}")
    minor = int(m[1])
    nearest = min(offered, key=lambda v: (abs(_minor(v) - minor), -_minor(v)))
    if abs(_minor(nearest) - minor) > 1:
        raise ModalInvalidError(f"Image.debian_slim(python_version={asked!r}): Python "
                                f"3.{minor} is not offered here; offered: {listing} "
                                "(ray-sandbox/python:<version>), or use Image.from_registry "
                                "with a registry image")
    if _minor(nearest) != minor:
        warnings.warn(f"Image.debian_slim(python_version={asked!r}): Python {nearest} is the "
                      f"nearest offered here (ray-sandbox/python:{nearest}); offered: {listing}",
                      UserWarning, stacklevel=4)
    return nearest


class Secret:
    """Environment variables for a sandbox or an exec."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    @static
    def from_dict(env_dict: Mapping[str, str | None]) -> Secret:
        return Secret({k: v for k, v in env_dict.items() if v is not None})

    @static
    def from_local_environ(env_keys: Sequence[str]) -> Secret:
        missing = [k for k in env_keys if k not in os.environ]
        if missing:
            raise ModalNotFoundError(f"not in the local environment: {', '.join(missing)}")
        return Secret({k: os.environ[k] for k in env_keys})

    @static
    def from_name(name: str, **options: Any) -> Secret:
        raise NotImplementedError(f"Secret.from_name({name!r}): there is no secret store "
                                  "here; use Secret.from_dict or from_local_environ")
