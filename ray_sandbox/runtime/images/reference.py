"""Image references: what users write (``python:3.12-slim``, ``oci:/x:tag``,
``ray-sandbox/python``, ``localhost/task:v1``) parsed into an :class:`ImageRef`, and sha256
digests."""

from __future__ import annotations

import ipaddress
import os
import re
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import ImageReferenceError

DEFAULT_REGISTRY = "docker.io"
LOCAL_NAMESPACE = "ray-sandbox"  # made by this project's offline builders, on any node
BUILT_NAMESPACE = "localhost"  # built on this node (``image build -t``), as podman names them


class Transport(StrEnum):
    DOCKER = "docker"
    OCI = "oci"
    OCI_ARCHIVE = "oci-archive"
    DOCKER_ARCHIVE = "docker-archive"
    DIR = "dir"
    LOCAL = "local"  # built on this node: ray-sandbox/ (image_builders), localhost/ (builds)


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
    def built_here(self) -> bool:
        """A name given on this node to an image built here (``localhost/NAME``)."""
        return self.transport is Transport.LOCAL and self.repository is not None and \
            self.repository.startswith(f"{BUILT_NAMESPACE}/")

    @property
    def reads_host_files(self) -> bool:
        """An image read from a path of the node (``oci:``, ``oci-archive:``,
        ``docker-archive:``, ``dir:``): whoever names it chooses what the node reads; and a
        node's own build (``localhost/…``), which is the node's files under another name."""
        return self.transport in _FILE_TRANSPORTS or self.built_here

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
    ``ray-sandbox/<name>[:tag]`` without a registry names an image of the offline builders and
    ``localhost/<name>[:tag]`` (no port) one built on this node; with ``docker://`` both name
    registries.
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
    local = (registry == DEFAULT_REGISTRY and name.startswith(f"{LOCAL_NAMESPACE}/")) or \
        registry == BUILT_NAMESPACE
    if allow_local and local:
        if digest:
            raise ImageReferenceError(f"{text!r}: local images are addressed by tag, not digest")
        return ImageRef(transport=Transport.LOCAL, repository=name, tag=tag or "latest")
    return ImageRef(transport=Transport.DOCKER, registry=registry, repository=repository,
                    tag=tag or (None if digest else "latest"), digest=digest)


def built_name(name: str) -> ImageRef:
    """The node-local reference of a build named ``name`` (``image build -t NAME``):
    ``localhost/NAME``, or ``name`` itself if it is one. A name with a registry, a transport or
    the builders' ``ray-sandbox/`` raises :class:`ImageReferenceError`: a build is only ever
    named on this node."""
    text = name.strip() if isinstance(name, str) else name
    try:
        ref = parse_reference(text)
        first = text.split("/", 1)[0] if "/" in text else ""  # a registry, if it has . or :
        registry_written = text.startswith("docker://") or first == BUILT_NAMESPACE or \
            any(c in first for c in ".:[")
        if ref.transport is Transport.DOCKER and not registry_written:
            ref = parse_reference(f"{BUILT_NAMESPACE}/{text}")
    except ImageReferenceError as exc:
        raise ImageReferenceError(f"{name!r} cannot name a build ({exc.message}); write NAME "
                                  f"or {BUILT_NAMESPACE}/NAME, lowercase, [:tag]") from None
    if not ref.built_here:
        raise ImageReferenceError(
            f"{name!r} cannot name a build: builds are named on this node only, as "
            f"{BUILT_NAMESPACE}/NAME[:tag] (a bare NAME[:tag] becomes that); pushing to a "
            f"registry is not supported and {LOCAL_NAMESPACE}/ is the offline builders'")
    return ref


class PullPolicy(StrEnum):
    IF_NOT_PRESENT = "if-not-present"
    ALWAYS = "always"  # re-resolve the tag; a moved tag pulls the new image
    NEVER = "never"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hex(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ImageReferenceError(f"not a sha256 digest: {digest!r}")
    return digest.split(":", 1)[1]
