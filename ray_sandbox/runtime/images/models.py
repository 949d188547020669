"""What the store knows about an image: the platform it is for, its config, the records
kept on disk, and the OCI manifests read to find and verify it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError, ImageCorruptError
from ..skopeo import ARCH_ALIASES, host_architecture
from .reference import ImageRef, _hex

_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}


class Platform(BaseModel):
    """The OS/architecture images are selected for (default: this host)."""

    model_config = ConfigDict(frozen=True)

    os: str = "linux"
    architecture: str = Field(default_factory=host_architecture)
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``linux/arm64`` or ``linux/arm/v7``."""
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"platform must look like os/arch[/variant], got {text!r}")
        return cls(os=parts[0], architecture=ARCH_ALIASES.get(parts[1], parts[1]),
                   variant=parts[2] if len(parts) == 3 else None)

    def __str__(self) -> str:
        return _platform_label(self.os, self.architecture, self.variant)

    def matches(self, os_name: str, architecture: str, variant: str | None) -> bool:
        if os_name != self.os or ARCH_ALIASES.get(architecture, architecture) != self.architecture:
            return False
        # A variant missing on either side matches: arm64 images rarely name one.
        return not (self.variant and variant) or variant == self.variant


def _platform_label(os_name: str | None, architecture: str | None, variant: str | None) -> str:
    return "/".join(p for p in (os_name, architecture, variant) if p)


class ImageConfig(BaseModel):
    """What the runtime needs from an OCI image config."""

    model_config = ConfigDict(frozen=True)

    env: list[str] = Field(default_factory=list)  # "KEY=VALUE", in image order
    working_dir: str = ""
    user: str = ""
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    stop_signal: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    architecture: str
    os: str
    variant: str | None = None

    @classmethod
    def from_oci(cls, blob: dict[str, Any]) -> ImageConfig:
        """Build from an OCI/Docker config JSON (Go writes ``null`` for empty lists)."""
        inner = blob.get("config") or {}
        fields = {
            "env": inner.get("Env"), "working_dir": inner.get("WorkingDir"),
            "user": inner.get("User"), "entrypoint": inner.get("Entrypoint"),
            "cmd": inner.get("Cmd"), "stop_signal": inner.get("StopSignal"),
            "labels": inner.get("Labels"), "architecture": blob.get("architecture"),
            "os": blob.get("os"), "variant": blob.get("variant"),
        }
        return cls.model_validate({k: v for k, v in fields.items() if v is not None})

    @property
    def env_map(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.env)


class Image(BaseModel):
    """An image unpacked in the store."""

    model_config = ConfigDict(frozen=True)

    ref: str  # normalized reference it was looked up by; the digest if no reference points here
    digest: str  # manifest digest, "sha256:…"
    rootfs: Path
    config: ImageConfig
    size_bytes: int  # disk used by rootfs + blobs (shared blobs count in every image)
    created: float  # when it was unpacked on this node (epoch seconds)
    last_used: float
    # the image this one adds a layer of changes to (a filesystem image, docs/snapshots.md):
    # its rootfs is an overlay of that layer on the parent's, which it keeps stored
    parent: str | None = None


class _ImageRecord(BaseModel):
    digest: str
    config: ImageConfig
    size_bytes: int
    created: float
    parent: str | None = None  # see Image.parent


class _RefRecord(BaseModel):
    ref: str
    platform: str
    digest: str
    source_digest: str | None = None  # registry digest of the tag (index or manifest)


class _Descriptor(BaseModel):
    digest: str
    platform: dict[str, Any] | None = None


class _Manifest(BaseModel):
    """An OCI/Docker manifest or index; only the fields the store reads."""

    media_type: str | None = Field(None, alias="mediaType")
    config: _Descriptor | None = None
    layers: list[_Descriptor] = Field(default_factory=list)
    manifests: list[_Descriptor] = Field(default_factory=list)

    @property
    def is_index(self) -> bool:
        return self.media_type in _INDEX_TYPES or (self.config is None and bool(self.manifests))


def _parse_manifest(raw: bytes, ref: ImageRef) -> _Manifest:
    try:
        return _Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise ImageCorruptError(f"{ref}: unreadable manifest", stderr=str(exc)) from None


def _blob_digests(manifest: _Manifest) -> list[str]:
    config = [manifest.config.digest] if manifest.config else []
    return config + [layer.digest for layer in manifest.layers]


def _read_layout(layout: Path) -> tuple[str, ImageConfig]:
    """(manifest digest, config) of the one image skopeo or a builder put into ``layout``."""
    blobs = layout / "blobs" / "sha256"
    try:
        index = _Manifest.model_validate_json((layout / "index.json").read_bytes())
        (entry,) = index.manifests
        manifest = _Manifest.model_validate_json((blobs / _hex(entry.digest)).read_bytes())
        if manifest.config is None:
            raise ValueError("manifest has no config")
        blob = json.loads((blobs / _hex(manifest.config.digest)).read_bytes())
        return entry.digest, ImageConfig.from_oci(blob)
    except (OSError, ValueError) as exc:
        raise ImageCorruptError(f"{layout} does not hold one readable image: {exc}") from None
