"""Image references and the node-local image store.

(Over 600 lines: references, models and the store with its eviction are due to become an
``images`` package, docs/ENGINEERING.md "what comes next", issue 16.)

:func:`parse_reference` turns what users write (``python:3.12-slim``, ``oci:/x:tag``,
``ray-sandbox/python``) into an :class:`ImageRef`. :class:`ImageStore` pulls each image once per
node (skopeo), unpacks it once into a shared read-only rootfs keyed by manifest digest (umoci) and
answers cached lookups without starting a process. Layout under the store root (default
``paths.images()``: ``$RAY_SANDBOX_IMAGES`` or ``home()/images``; see docs/images.md)::

    blobs/sha256/<hex>        pool of every blob, hard-linked into the images that use it
    sha256/<hex>/             one image, published by a single rename (never half-visible)
        image.json            digest, parsed config, size
        used                  empty; its mtime is the last use (LRU eviction)
        pins/<owner>          one empty file per pin (live sandbox); pinned images are kept
        oci/                  an OCI layout holding just this image (tag "image")
        rootfs/               the unpacked root filesystem, used read-only
    refs/<key>.json           reference (+ platform) -> digest
    locks/<name>.lock         flock files: ref-<key> (resolve/pull), img-<hex> (unpack/pin/remove)
    tmp/<name>.<random>/      work directories, each owned by whoever holds locks/<name>.lock
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import image_builders, paths
from .errors import (
    ConfigError,
    ImageBusyError,
    ImageCorruptError,
    ImageInUseError,
    ImageNotFoundError,
    ImageReferenceError,
    PlatformNotFoundError,
    StoreFullError,
)
from .skopeo import ARCH_ALIASES, Skopeo, host_architecture
from .umoci import Umoci

DEFAULT_REGISTRY = "docker.io"
DEFAULT_PULL_TIMEOUT = 1800.0
LOCAL_NAMESPACE = "ray-sandbox"
_TAG = "image"  # the tag every per-image OCI layout uses
_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}

Progress = Callable[[str], None]




# ----------------------------------------------------------------------------- references

class Transport(StrEnum):
    DOCKER = "docker"
    OCI = "oci"
    OCI_ARCHIVE = "oci-archive"
    DOCKER_ARCHIVE = "docker-archive"
    DIR = "dir"
    LOCAL = "local"  # built on this node by image_builders


_FILE_TRANSPORTS = (Transport.OCI, Transport.OCI_ARCHIVE, Transport.DOCKER_ARCHIVE, Transport.DIR)

# The grammar of github.com/distribution/reference.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_DOCKER_REF = re.compile(
    rf"^(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_LAYOUT_TAG = re.compile(r"[A-Za-z0-9._-]+")  # containers/image's rule for oci: references
_OWNER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,199}$")


class ImageRef(BaseModel):
    """A parsed image reference; ``str()`` gives its normalized form."""

    model_config = ConfigDict(frozen=True)

    transport: Transport
    registry: str | None = None  # docker: "docker.io", "127.0.0.1:5000", "[::1]:5000"
    repository: str | None = None  # docker and local: "library/python"
    tag: str | None = None
    digest: str | None = None
    path: Path | None = None  # file transports
    reference: str | None = None  # file transports: tag or name inside the layout/archive

    def __str__(self) -> str:
        if self.transport is Transport.LOCAL:
            return f"{self.repository}:{self.tag}"
        if self.transport is Transport.DOCKER:
            tag = f":{self.tag}" if self.tag else ""
            digest = f"@{self.digest}" if self.digest else ""
            return f"docker://{self.registry}/{self.repository}{tag}{digest}"
        inner = f":{self.reference}" if self.reference else ""
        return f"{self.transport.value}:{self.path}{inner}"

    @property
    def source(self) -> str:
        """The skopeo source name; a digest wins over a tag (skopeo refuses both)."""
        if self.transport is Transport.DOCKER and self.digest:
            return self.at_digest(self.digest)
        return str(self)

    def at_digest(self, digest: str) -> str:
        """The skopeo source for one manifest of this repository."""
        return f"docker://{self.registry}/{self.repository}@{digest}"

    @property
    def host(self) -> str | None:
        """The registry host without port or IPv6 brackets."""
        if self.registry is None:
            return None
        if self.registry.startswith("["):
            return self.registry[1:self.registry.index("]")]
        return self.registry.rsplit(":", 1)[0] if ":" in self.registry else self.registry


def parse_reference(text: str) -> ImageRef:
    """Parse ``text`` into an :class:`ImageRef` or raise :class:`ImageReferenceError`.

    Bare names are Docker references (``python`` -> ``docker://docker.io/library/python:latest``);
    ``ray-sandbox/<name>[:tag]`` without a registry names a locally built image.
    """
    if not isinstance(text, str):
        raise ImageReferenceError(f"image reference must be a string, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ImageReferenceError("empty image reference")
    for transport in _FILE_TRANSPORTS:
        if text.startswith(f"{transport.value}:"):
            return _parse_file_ref(transport, text[len(transport.value) + 1:], text)
    if text.startswith("docker://"):
        return _parse_docker_ref(text[len("docker://"):], text, allow_local=False)
    return _parse_docker_ref(text, text, allow_local=True)


def _parse_file_ref(transport: Transport, rest: str, text: str) -> ImageRef:
    # Like containers/image, the path ends at the first colon.
    path, _, inner = rest.partition(":")
    if not path:
        raise ImageReferenceError(f"{text!r}: missing path")
    if inner:
        if transport is Transport.DIR:
            raise ImageReferenceError(f"{text!r}: dir: takes no tag")
        if transport is Transport.DOCKER_ARCHIVE:  # a docker reference or @<source index>
            valid = _DOCKER_REF.match(inner) or re.fullmatch(r"@\d+", inner)
        else:
            valid = _LAYOUT_TAG.fullmatch(inner)
        if not valid:
            raise ImageReferenceError(f"{text!r}: bad reference {inner!r} inside the image")
    return ImageRef(transport=transport, path=Path(os.path.abspath(path)), reference=inner or None)


def _parse_docker_ref(rest: str, text: str, *, allow_local: bool) -> ImageRef:
    m = _DOCKER_REF.match(rest)
    if not m or len(m["name"]) > 255:
        raise ImageReferenceError(f"invalid image reference {text!r}")
    name, tag, digest = m["name"], m["tag"], m["digest"]
    if digest is not None and not _DIGEST.match(digest):
        raise ImageReferenceError(f"{text!r}: only sha256 digests (64 lowercase hex) are supported")
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, repository = first, remainder
    else:
        registry, repository = DEFAULT_REGISTRY, name
    if registry == "index.docker.io":
        registry = DEFAULT_REGISTRY
    if repository != repository.lower():
        raise ImageReferenceError(f"{text!r}: repository names must be lowercase")
    if registry == DEFAULT_REGISTRY and "/" not in repository:
        repository = f"library/{repository}"
    if allow_local and registry == DEFAULT_REGISTRY and name.startswith(f"{LOCAL_NAMESPACE}/"):
        if digest:
            raise ImageReferenceError(f"{text!r}: local images are addressed by tag, not digest")
        return ImageRef(transport=Transport.LOCAL, repository=name, tag=tag or "latest")
    return ImageRef(transport=Transport.DOCKER, registry=registry, repository=repository,
                    tag=tag or (None if digest else "latest"), digest=digest)


# ----------------------------------------------------------------------------- models

class PullPolicy(StrEnum):
    IF_NOT_PRESENT = "if-not-present"
    ALWAYS = "always"  # re-resolve the tag; a moved tag pulls the new image
    NEVER = "never"


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
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)

    def matches(self, os_name: str, architecture: str, variant: str | None) -> bool:
        if os_name != self.os or ARCH_ALIASES.get(architecture, architecture) != self.architecture:
            return False
        # A variant missing on either side matches: arm64 images rarely name one.
        return not (self.variant and variant) or variant == self.variant


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
    def from_oci(cls, blob: dict) -> ImageConfig:
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


class _ImageRecord(BaseModel):
    digest: str
    config: ImageConfig
    size_bytes: int
    created: float


class _RefRecord(BaseModel):
    ref: str
    platform: str
    digest: str
    source_digest: str | None = None  # registry digest of the tag (index or manifest)


class _Resolved(NamedTuple):
    source_digest: str  # digest of what the tag points to (an index or a manifest)
    digest: str  # the manifest for our platform
    blobs: list[str]  # its config and layers, to reuse from the pool


class _Descriptor(BaseModel):
    digest: str
    platform: dict | None = None


class _Manifest(BaseModel):
    """An OCI/Docker manifest or index; only the fields the store reads."""

    media_type: str | None = Field(None, alias="mediaType")
    config: _Descriptor | None = None
    layers: list[_Descriptor] = Field(default_factory=list)
    manifests: list[_Descriptor] = Field(default_factory=list)

    @property
    def is_index(self) -> bool:
        return self.media_type in _INDEX_TYPES or (self.config is None and bool(self.manifests))


LOCAL_IMAGES: dict[str, Callable[..., None]] = {
    f"{LOCAL_NAMESPACE}/busybox:latest": image_builders.write_busybox_layout,
    f"{LOCAL_NAMESPACE}/python:latest": image_builders.write_python_layout,
}


def find_authfile() -> Path | None:
    """The first existing containers/docker auth file, in the order skopeo documents."""
    candidates = [os.environ.get("REGISTRY_AUTH_FILE")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        candidates.append(f"{os.environ['XDG_RUNTIME_DIR']}/containers/auth.json")
    candidates.append(str(Path.home() / ".docker" / "config.json"))
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _hex(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ImageReferenceError(f"not a sha256 digest: {digest!r}")
    return digest.split(":", 1)[1]


def _disk_usage(root: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _rmtree(path: Path) -> None:
    """Delete a file or tree; read-only directories inside images are made writable first."""

    def retry_writable(func: Callable[[str], object], name: str, exc_info: tuple) -> None:
        if isinstance(exc_info[1], FileNotFoundError):
            return
        if not isinstance(exc_info[1], PermissionError):
            raise exc_info[1]
        os.chmod(os.path.dirname(name), 0o700)
        func(name)

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=retry_writable)
    else:
        path.unlink(missing_ok=True)


def _platform_label(os_name: str | None, architecture: str | None, variant: str | None) -> str:
    return "/".join(p for p in (os_name, architecture, variant) if p)


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


# ----------------------------------------------------------------------------- the store

class ImageStore:
    """Pull, unpack, cache, pin and evict images on this node; safe across threads and processes.

    ``max_bytes`` caps the store: after each new image the least recently used unpinned images
    are removed until it fits. ``insecure_registries`` (``host`` or ``host:port``) are reached
    over plain HTTP / without TLS verification; loopback registries always are.
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        max_bytes: int | None = None,
        insecure_registries: Iterable[str] = (),
        platform: Platform | str | None = None,
        authfile: Path | str | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else paths.images()
        self.max_bytes = max_bytes
        self.insecure_registries = frozenset(insecure_registries)
        self.platform = (Platform.parse(platform) if isinstance(platform, str)
                         else platform or Platform())
        auth = Path(authfile) if authfile is not None else find_authfile()
        self._skopeo = Skopeo(os=self.platform.os, arch=self.platform.architecture,
                              variant=self.platform.variant, authfile=auth)
        self._umoci = Umoci()
        self._make_dirs()
        self._sweep()

    # -- public API ---------------------------------------------------------------------

    def get(
        self,
        ref: str,
        *,
        policy: PullPolicy = PullPolicy.IF_NOT_PRESENT,
        timeout: float = DEFAULT_PULL_TIMEOUT,
        progress: Progress | None = None,
    ) -> Image:
        """The image for ``ref``, pulled or built and unpacked first if needed.

        A cache hit reads two small files and starts no process. With ``ALWAYS`` the reference
        is re-resolved (a moved tag pulls the new image); ``NEVER`` never fetches. Locally built
        images (``ray-sandbox/…``) are only built when missing (rebuild with :meth:`build`).
        """
        parsed = parse_reference(ref)
        refetch = policy is PullPolicy.ALWAYS and parsed.transport is not Transport.LOCAL
        return self._get(parsed, refetch=refetch, fetch=policy is not PullPolicy.NEVER,
                         timeout=timeout, progress=progress)

    def pull(
        self, ref: str, *, timeout: float = DEFAULT_PULL_TIMEOUT, progress: Progress | None = None
    ) -> Image:
        """Re-resolve ``ref`` and fetch it if it changed (``get`` with ``ALWAYS``)."""
        return self.get(ref, policy=PullPolicy.ALWAYS, timeout=timeout, progress=progress)

    def build(
        self, ref: str = f"{LOCAL_NAMESPACE}/python:latest", *, force: bool = False,
        timeout: float = DEFAULT_PULL_TIMEOUT, progress: Progress | None = None,
    ) -> Image:
        """Build a local ``ray-sandbox/…`` image (again, with ``force``)."""
        parsed = parse_reference(ref)
        if parsed.transport is not Transport.LOCAL:
            raise ImageReferenceError(f"{ref!r} is not a local image; known: {list(LOCAL_IMAGES)}")
        return self._get(parsed, refetch=force, fetch=True, timeout=timeout, progress=progress)

    def inspect(self, ref_or_digest: str) -> Image:
        """The stored image for a reference or ``sha256:`` digest; never fetches."""
        digest, parsed = self._resolve_local(ref_or_digest)
        image = self._load(digest, ref=str(parsed) if parsed else digest, touch=False)
        if image is None:
            raise ImageNotFoundError(f"{ref_or_digest} is not in the image store")
        return image

    def list(self) -> list[Image]:
        """One entry per reference, plus one per image no reference points to (ref = digest)."""
        images: list[Image] = []
        referenced: set[str] = set()
        for record in self._ref_records():
            if (image := self._load(record.digest, ref=record.ref, touch=False)) is not None:
                images.append(image)
                referenced.add(record.digest)
        for entry in os.scandir(self.root / "sha256"):
            digest = f"sha256:{entry.name}"
            if digest not in referenced and (
                image := self._load(digest, ref=digest, touch=False)
            ) is not None:
                images.append(image)
        return sorted(images, key=lambda i: i.ref)

    def remove(self, ref_or_digest: str) -> list[str]:
        """Untag a reference (deleting the image when no reference is left) or delete an image
        by digest with all its references. Returns the digests deleted.

        Raises :class:`ImageInUseError` if the image would be deleted while pinned.
        """
        digest, parsed = self._resolve_local(ref_or_digest)
        with self._locked(f"img-{_hex(digest)}", time.monotonic() + 60):
            refs = [self._ref_path(r) for r in self._ref_records() if r.digest == digest]
            doomed = refs if parsed is None else [self._ref_file(self._ref_key(parsed))]
            stored = (self._dir(digest) / "image.json").exists()
            if not stored and not refs:
                raise ImageNotFoundError(f"{ref_or_digest} is not in the image store")
            deletes_image = stored and len(doomed) == len(refs)
            if deletes_image and (owners := self.pins(digest)):
                raise ImageInUseError(f"{digest} is pinned by {sorted(owners)}")
            for path in doomed:
                path.unlink(missing_ok=True)
            removed = [digest] if deletes_image and self._delete_image(digest) else []
        self._gc_blobs()
        return removed

    def prune(self, *, all_images: bool = False) -> list[str]:
        """Delete unpinned images no reference points to (every unpinned one with
        ``all_images``), orphaned blobs and stale work directories. Returns deleted digests."""
        self._sweep()
        referenced = {r.digest for r in self._ref_records()}
        removed = [
            f"sha256:{entry.name}" for entry in os.scandir(self.root / "sha256")
            if (all_images or f"sha256:{entry.name}" not in referenced)
            and self._delete_if_unpinned(f"sha256:{entry.name}")
        ]
        self._drop_dangling_refs()
        self._gc_blobs()
        return removed

    def pin(self, digest: str, owner: str) -> None:
        """Keep ``digest`` from eviction and removal until ``owner`` unpins it (survives
        restarts). Raises ImageNotFoundError if the image is gone (e.g. removed after get)."""
        if not _OWNER.match(owner):
            raise ConfigError(f"pin owner must match {_OWNER.pattern}, got {owner!r}")
        with self._locked(f"img-{_hex(digest)}", time.monotonic() + 60):
            pins = self._dir(digest) / "pins"
            if not pins.is_dir():
                raise ImageNotFoundError(f"{digest} is not in the image store")
            (pins / owner).touch()

    def unpin(self, digest: str, owner: str) -> None:
        """Drop ``owner``'s pin; idempotent."""
        if _OWNER.match(owner):
            (self._dir(digest) / "pins" / owner).unlink(missing_ok=True)

    def pins(self, digest: str) -> set[str]:
        try:
            return set(os.listdir(self._dir(digest) / "pins"))
        except FileNotFoundError:
            return set()

    def usage(self) -> int:
        """Bytes used by all stored images (the number ``max_bytes`` is compared with)."""
        return sum(r.size_bytes for _, r in self._image_records())

    def _get(
        self, ref: ImageRef, *, refetch: bool, fetch: bool, timeout: float,
        progress: Progress | None,
    ) -> Image:
        key = self._ref_key(ref)
        if not refetch and (image := self._lookup(ref, key)) is not None:
            return image
        if not fetch:
            raise ImageNotFoundError(f"{ref} is not in the image store (pull policy never)")
        self._make_dirs()  # cheap, and survives an operator wiping the store under a live process
        deadline = time.monotonic() + timeout
        with self._locked(f"ref-{key}", deadline):
            # Whoever held the lock before us may have just fetched it.
            if not refetch and (image := self._lookup(ref, key)) is not None:
                return image
            image = self._fetch(ref, key, deadline, progress or (lambda _: None))
        self._evict(keep=image.digest)
        return image

    # -- lookups --------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        for sub in ("blobs/sha256", "sha256", "refs", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _dir(self, digest: str) -> Path:
        return self.root / "sha256" / _hex(digest)

    @staticmethod
    def _key(ref: str, platform: str) -> str:
        return hashlib.sha256(f"{ref}\n{platform}".encode()).hexdigest()[:32]

    def _ref_key(self, ref: ImageRef) -> str:
        return self._key(str(ref), str(self.platform))

    def _ref_file(self, key: str) -> Path:
        return self.root / "refs" / f"{key}.json"

    def _ref_path(self, record: _RefRecord) -> Path:
        return self._ref_file(self._key(record.ref, record.platform))

    def _ref_record(self, key: str) -> _RefRecord | None:
        try:
            return _RefRecord.model_validate_json(self._ref_file(key).read_bytes())
        except FileNotFoundError:
            return None

    def _ref_records(self) -> list[_RefRecord]:
        records = []
        for entry in os.scandir(self.root / "refs"):
            try:
                records.append(_RefRecord.model_validate_json(Path(entry.path).read_bytes()))
            except (FileNotFoundError, ValidationError):
                continue  # removed meanwhile, or not ours
        return records

    def _image_records(self) -> list[tuple[float, _ImageRecord]]:
        found = []
        for entry in os.scandir(self.root / "sha256"):
            try:
                record = _ImageRecord.model_validate_json(
                    Path(entry.path, "image.json").read_bytes())
                found.append((os.stat(Path(entry.path, "used")).st_mtime, record))
            except FileNotFoundError:
                continue
        return found

    def _lookup(self, ref: ImageRef, key: str) -> Image | None:
        record = self._ref_record(key)
        return None if record is None else self._load(record.digest, ref=str(ref), touch=True)

    def _load(self, digest: str, *, ref: str, touch: bool) -> Image | None:
        path = self._dir(digest)
        try:
            record = _ImageRecord.model_validate_json((path / "image.json").read_bytes())
            if touch:
                os.utime(path / "used")
                last_used = time.time()
            else:
                last_used = os.stat(path / "used").st_mtime
        except FileNotFoundError:
            return None  # never stored, or removed by someone else just now
        return Image(ref=ref, digest=record.digest, rootfs=path / "rootfs", config=record.config,
                     size_bytes=record.size_bytes, created=record.created, last_used=last_used)

    def _resolve_local(self, ref_or_digest: str) -> tuple[str, ImageRef | None]:
        """(digest, parsed reference) of a stored reference; (digest, None) for a digest."""
        text = ref_or_digest.strip()
        if re.fullmatch(r"(sha256:)?[0-9a-f]{64}", text):
            return (text if text.startswith("sha256:") else f"sha256:{text}"), None
        parsed = parse_reference(text)
        record = self._ref_record(self._ref_key(parsed))
        if record is None:
            raise ImageNotFoundError(f"{parsed} is not in the image store")
        return record.digest, parsed

    # -- locking and work directories -----------------------------------------------------

    @contextmanager
    def _locked(self, name: str, deadline: float) -> Iterator[None]:
        """Exclusive flock on locks/<name>.lock; excludes other threads and processes alike
        because every acquisition opens its own file description."""
        fd = os.open(self.root / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
        try:
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ImageBusyError(f"timed out waiting for image lock {name}") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def _workdir(self, owner: str) -> Iterator[Path]:
        """A fresh tmp/<owner>.<random> directory; the caller holds locks/<owner>.lock."""
        path = Path(tempfile.mkdtemp(prefix=f"{owner}.", dir=self.root / "tmp"))
        try:
            yield path
        finally:
            _rmtree(path)

    def _sweep(self) -> None:
        """Remove work directories whose owner lock is free: their process died."""
        for entry in os.scandir(self.root / "tmp"):
            owner = entry.name.split(".", 1)[0]
            try:
                with self._locked(owner, deadline=0):
                    _rmtree(Path(entry.path))
            except ImageBusyError:
                continue  # a live pull, build or removal is using it

    # -- fetching -------------------------------------------------------------------------

    def _fetch(self, ref: ImageRef, key: str, deadline: float, progress: Progress) -> Image:
        """Resolve, copy or build, verify, unpack and publish ``ref``; caller holds ref-<key>."""
        resolved = None
        if ref.transport is Transport.DOCKER:
            progress(f"resolving {ref}")
            resolved = self._resolve(ref, deadline)
            known = self._ref_record(key)
            if known and known.source_digest == resolved.source_digest and (
                image := self._load(known.digest, ref=str(ref), touch=True)
            ):
                return image  # the tag did not move
        try:
            with self._workdir(f"ref-{key}") as work:
                layout = work / "oci"
                self._materialize(ref, resolved, layout, work, deadline, progress)
                digest = self._ingest(layout, work, deadline, progress)
                record = _RefRecord(ref=str(ref), platform=str(self.platform), digest=digest,
                                    source_digest=resolved.source_digest if resolved else None)
                staged = work / "ref.json"
                staged.write_text(record.model_dump_json())
                os.replace(staged, self._ref_file(key))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"no space left in the image store {self.root}") from exc
            raise
        image = self._load(digest, ref=str(ref), touch=True)
        if image is None:
            raise ImageNotFoundError(f"{ref} was removed while it was being pulled")
        progress(f"ready {digest}")
        return image

    def _materialize(
        self, ref: ImageRef, resolved: _Resolved | None, layout: Path, work: Path,
        deadline: float, progress: Progress,
    ) -> None:
        """Put ``ref`` as ``layout:image``: build a local image or copy it with skopeo."""
        if ref.transport is Transport.LOCAL:
            builder = LOCAL_IMAGES.get(str(ref))
            if builder is None:
                raise ImageNotFoundError(f"no builder for {ref}; local images: "
                                         f"{sorted(LOCAL_IMAGES)}")
            progress(f"building {ref}")
            builder(layout, _TAG, timeout=_remaining(deadline))
            return
        source = ref.source
        if resolved is not None:
            source = ref.at_digest(resolved.digest)  # exactly what was resolved
            self._prelink(layout, resolved.blobs)
        progress(f"copying {ref}")
        self._skopeo.copy(source, f"oci:{layout}:{_TAG}", timeout=_remaining(deadline),
                          src_tls_verify=not self._insecure(ref), tmpdir=work)

    def _insecure(self, ref: ImageRef) -> bool:
        host = ref.host or ""
        return is_loopback(host) or ref.registry in self.insecure_registries \
            or host in self.insecure_registries

    def _resolve(self, ref: ImageRef, deadline: float) -> _Resolved:
        """Read the tag's manifest (one request) and pick the manifest for our platform."""
        tls = not self._insecure(ref)
        raw = self._skopeo.inspect_raw(ref.source, timeout=_remaining(deadline), tls_verify=tls)
        source_digest = _sha256(raw)
        top = _parse_manifest(raw, ref)
        if not top.is_index:
            return _Resolved(source_digest, source_digest, _blob_digests(top))
        for entry in top.manifests:
            p = entry.platform or {}
            if self.platform.matches(p.get("os", ""), p.get("architecture", ""), p.get("variant")):
                raw = self._skopeo.inspect_raw(ref.at_digest(entry.digest),
                                               timeout=_remaining(deadline), tls_verify=tls)
                return _Resolved(source_digest, entry.digest,
                                 _blob_digests(_parse_manifest(raw, ref)))
        offered = sorted({_platform_label(*((e.platform or {}).get(k) for k in
                                            ("os", "architecture", "variant")))
                          for e in top.manifests})
        raise PlatformNotFoundError(f"{ref} has no image for {self.platform}; it offers {offered}")

    def _prelink(self, layout: Path, digests: list[str]) -> None:
        """Hard-link blobs we already have into the new layout so skopeo skips downloading."""
        target = layout / "blobs" / "sha256"
        target.mkdir(parents=True, exist_ok=True)
        for digest in digests:
            try:
                os.link(self.root / "blobs" / "sha256" / _hex(digest), target / _hex(digest))
            except (FileNotFoundError, FileExistsError, ImageReferenceError):
                continue

    def _ingest(self, layout: Path, work: Path, deadline: float, progress: Progress) -> str:
        """Verify the single image in ``layout`` and publish it unless already stored."""
        digest, config = _read_layout(layout)
        if not self.platform.matches(config.os, config.architecture, config.variant):
            found = _platform_label(config.os, config.architecture, config.variant)
            raise PlatformNotFoundError(f"image is {found}, this store wants {self.platform}")
        with self._locked(f"img-{_hex(digest)}", deadline):
            target = self._dir(digest)
            if (target / "image.json").exists():
                return digest
            progress(f"unpacking {digest}")
            bundle = work / "image"
            self._umoci.unpack(f"{layout}:{_TAG}", bundle, timeout=_remaining(deadline))
            for extra in bundle.iterdir():  # umoci's runtime config and repack metadata
                if extra.name != "rootfs":
                    extra.unlink()
            layout.rename(bundle / "oci")
            (bundle / "pins").mkdir()
            (bundle / "used").touch()
            record = _ImageRecord(digest=digest, config=config, size_bytes=_disk_usage(bundle),
                                  created=time.time())
            (bundle / "image.json").write_text(record.model_dump_json())
            os.rename(bundle, target)
            for blob in (target / "oci" / "blobs" / "sha256").iterdir():
                try:
                    os.link(blob, self.root / "blobs" / "sha256" / blob.name)
                except FileExistsError:
                    continue
        return digest

    # -- removal --------------------------------------------------------------------------

    def _delete_image(self, digest: str) -> bool:
        """Rename the image away (it vanishes atomically), then delete it; hold img-<hex>."""
        hex_ = _hex(digest)
        try:
            doomed = Path(tempfile.mkdtemp(prefix=f"img-{hex_}.", dir=self.root / "tmp"))
            os.rename(self._dir(digest), doomed / "image")
        except FileNotFoundError:
            return False
        finally:
            _rmtree(doomed)
        return True

    def _delete_if_unpinned(self, digest: str, timeout: float = 1.0) -> bool:
        try:
            with self._locked(f"img-{_hex(digest)}", time.monotonic() + timeout):
                return not self.pins(digest) and self._delete_image(digest)
        except ImageBusyError:
            return False  # someone is pinning or removing it right now: not a candidate

    def _evict(self, keep: str) -> None:
        """Delete least recently used unpinned images until the store fits ``max_bytes``."""
        if self.max_bytes is None:
            return
        records = sorted(self._image_records(), key=lambda item: item[0])
        total = sum(r.size_bytes for _, r in records)
        for _, record in records:
            if total <= self.max_bytes:
                break
            if record.digest != keep and self._delete_if_unpinned(record.digest):
                total -= record.size_bytes
        self._drop_dangling_refs()
        self._gc_blobs()

    def _drop_dangling_refs(self) -> None:
        for record in self._ref_records():
            if not (self._dir(record.digest) / "image.json").exists():
                self._ref_path(record).unlink(missing_ok=True)

    def _gc_blobs(self) -> None:
        """Delete pool blobs no image links to. A pull that links one concurrently keeps its
        own hard link, so nothing in flight is lost."""
        for entry in os.scandir(self.root / "blobs" / "sha256"):
            try:
                if entry.stat(follow_symlinks=False).st_nlink == 1:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue


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
