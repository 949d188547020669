"""The node-local image store: :class:`ImageStore` pulls each image once per node (skopeo),
builds the offline ones (:data:`LOCAL_IMAGES`), unpacks each once into a shared read-only
rootfs keyed by manifest digest (umoci) and answers cached lookups without starting a process.
Its files are described in :mod:`.storedir`.

(~620 lines: the store's public operations, each taking the store's lock the same way; the
reference parsing, eviction, pins, layers and pulls already live in their own modules.)"""

from __future__ import annotations

import builtins
import errno
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

from .. import image_builders, paths
from ..config import PullNetwork
from ..errors import (
    ImageError,
    ImageNotFoundError,
    ImageReferenceError,
    PlatformNotFoundError,
    RegistryUnreachableError,
    StoreFullError,
)
from ..network import pull as _pull
from ..skopeo import Skopeo
from ..umoci import Umoci
from . import eviction, layers
from . import pins as _pins
from .models import (
    Image,
    ImageConfig,
    Platform,
    _blob_digests,
    _ImageRecord,
    _parse_manifest,
    _platform_label,
    _read_layout,
    _RefRecord,
)
from .reference import (
    LOCAL_NAMESPACE,
    ImageRef,
    PullPolicy,
    Transport,
    _hex,
    built_name,
    is_loopback,
    parse_reference,
)
from .storedir import StoreDir, ref_key

DEFAULT_PULL_TIMEOUT = 1800.0
_TAG = "image"  # the tag every per-image OCI layout uses

Progress = Callable[[str], None]


class _Resolved(NamedTuple):
    source_digest: str  # digest of what the tag points to (an index or a manifest)
    digest: str  # the manifest for our platform
    blobs: list[str]  # its config and layers, to reuse from the pool


_FULL_BYTES = 1 << 20  # free space under which a failed unpack is taken for a full disk


@dataclass(eq=False)
class LocalImage:
    """An image this node builds itself: ``build(layout, tag, timeout=)`` writes it, from
    what ``recipe`` digests (:func:`.image_builders.recipe`). A stored image of another
    recipe is rebuilt on use; tags of one recipe share one build."""

    build: Callable[..., None]
    recipe: str


_PYTHON = {version: LocalImage(partial(image_builders.write_python_layout, version=version),
                               image.recipe)
           for version, image in image_builders.PYTHON_IMAGES.items()}
LOCAL_IMAGES: dict[str, LocalImage] = {
    f"{LOCAL_NAMESPACE}/busybox:latest": LocalImage(image_builders.write_busybox_layout,
                                                    image_builders.BUSYBOX_RECIPE),
    **{f"{LOCAL_NAMESPACE}/python:{version}": local for version, local in _PYTHON.items()},
    f"{LOCAL_NAMESPACE}/python:latest": _PYTHON[image_builders.PYTHON_LATEST],
    f"{LOCAL_NAMESPACE}/docker:latest": LocalImage(image_builders.write_docker_layout,  # docker.py
                                                   image_builders.DOCKER_IMAGE.recipe),
}
_UNREACHABLE_HINT = (
    "Without a registry this node reaches, use an image built here: "
    + ", ".join(r.removesuffix(":latest") for r in LOCAL_IMAGES)
    + " (ray-sandbox image build NAME), or one already stored (ray-sandbox image ls)")


def _nearly_full(path: Path) -> bool:
    """Less than _FULL_BYTES free on the filesystem of ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_BYTES


def find_authfile() -> Path | None:
    """The first existing containers/docker auth file, in the order skopeo documents."""
    candidates = [os.environ.get("REGISTRY_AUTH_FILE")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        candidates.append(f"{os.environ['XDG_RUNTIME_DIR']}/containers/auth.json")
    candidates.append(str(Path.home() / ".docker" / "config.json"))
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


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


def _link_tree(src: Path, dest: Path) -> None:
    """``dest`` as a copy of the directory ``src`` (this process's own files) whose files
    are hard links (copies across filesystems)."""
    for dirpath, _, filenames in os.walk(src):
        target = dest / os.path.relpath(dirpath, src)
        target.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            try:
                os.link(os.path.join(dirpath, name), target / name)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(os.path.join(dirpath, name), target / name)


def _local_image(ref: ImageRef) -> LocalImage | None:
    return LOCAL_IMAGES.get(str(ref)) if ref.transport is Transport.LOCAL else None


def _current(ref: ImageRef, record: _RefRecord) -> bool:
    """Whether a stored reference is still what it names: a local image built from another
    recipe (an older builder, on a node that ran an older version) is not."""
    local = _local_image(ref)
    return local is None or record.source_digest == local.recipe


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


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
        self._dir = StoreDir(self.root)
        self._dir.make_dirs()
        self._dir.sweep()

    # -- public API ---------------------------------------------------------------------

    def get(
        self,
        ref: str,
        *,
        policy: PullPolicy = PullPolicy.IF_NOT_PRESENT,
        timeout: float = DEFAULT_PULL_TIMEOUT,
        progress: Progress | None = None,
        network: PullNetwork = "node",
    ) -> Image:
        """The image for ``ref``, pulled or built and unpacked first if needed.

        A cache hit reads two small files and starts no process. With ``ALWAYS`` the reference
        is re-resolved (a moved tag pulls the new image); ``NEVER`` never fetches. Locally built
        images (``ray-sandbox/…``) are only built when missing or made by another recipe
        (rebuild with :meth:`build`); ``localhost/…`` names are never fetched (:meth:`tag`).
        ``network="public"`` pulls from a registry in a namespace of the pull's own that
        reaches only public addresses (:mod:`..network.pull`); the cache is the same.
        """
        parsed = parse_reference(ref)
        refetch = policy is PullPolicy.ALWAYS and parsed.transport is not Transport.LOCAL
        return self._get(parsed, refetch=refetch, fetch=policy is not PullPolicy.NEVER,
                         timeout=timeout, progress=progress, network=network)

    def pull(
        self, ref: str, *, timeout: float = DEFAULT_PULL_TIMEOUT, progress: Progress | None = None,
        network: PullNetwork = "node",
    ) -> Image:
        """Re-resolve ``ref`` and fetch it if it changed (``get`` with ``ALWAYS``)."""
        return self.get(ref, policy=PullPolicy.ALWAYS, timeout=timeout, progress=progress,
                        network=network)

    def build(
        self, ref: str = f"{LOCAL_NAMESPACE}/python:latest", *, force: bool = False,
        timeout: float = DEFAULT_PULL_TIMEOUT, progress: Progress | None = None,
    ) -> Image:
        """Build a local ``ray-sandbox/…`` image (again, with ``force``)."""
        parsed = parse_reference(ref)
        if parsed.transport is not Transport.LOCAL:
            raise ImageReferenceError(f"{ref!r} is not a local image; known: {list(LOCAL_IMAGES)}")
        return self._get(parsed, refetch=force, fetch=True, timeout=timeout, progress=progress)

    def tag(self, ref_or_digest: str, name: str, *, timeout: float = 60.0) -> Image:
        """Name a stored image ``localhost/NAME`` on this node (a bare ``NAME[:tag]`` means
        that too; :func:`.reference.built_name`); a name that named another image moves.
        What ``image build -t NAME`` does with its result. Raises ImageNotFoundError if the
        image is not stored, ImageReferenceError for any other kind of name."""
        target = built_name(name)
        digest, _ = self._resolve_local(ref_or_digest)
        key = self._ref_key(target)
        deadline = time.monotonic() + timeout
        self._dir.make_dirs()
        with self._dir.locked(f"ref-{key}", deadline):
            image = self._point(target, key, digest, None, deadline)
        if image is None:
            raise ImageNotFoundError(f"{ref_or_digest} is not in the image store")
        return image

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
        for record in self._dir.ref_records():
            if (image := self._dir.load(record.digest, ref=record.ref, touch=False)) is not None:
                images.append(image)
                referenced.add(record.digest)
        for digest in self._dir.digests():
            if digest not in referenced and (
                image := self._dir.load(digest, ref=digest, touch=False)
            ) is not None:
                images.append(image)
        return sorted(images, key=lambda i: i.ref)

    def remove(self, ref_or_digest: str) -> builtins.list[str]:
        """Untag a reference (deleting the image when no reference is left) or delete an image
        by digest with all its references. Returns the digests deleted.

        Raises :class:`ImageInUseError` if the image would be deleted while pinned.
        """
        digest, parsed = self._resolve_local(ref_or_digest)
        untag = None if parsed is None else self._dir.ref_file(self._ref_key(parsed))
        return eviction.remove(self._dir, digest, untag=untag, name=ref_or_digest)

    def prune(self, *, all_images: bool = False) -> builtins.list[str]:
        """Delete unpinned images no reference points to (every unpinned one with
        ``all_images``), orphaned blobs and stale work directories. Returns deleted digests."""
        return eviction.prune(self._dir, all_images=all_images)

    def pin(self, digest: str, owner: str, *, home: Path | None = None) -> None:
        """Keep ``digest`` from eviction and removal until ``owner`` unpins it (survives
        restarts). With ``home`` the pin is a sandbox's, ``owner`` is
        ``<pins.home_key(home)>:<sandbox id>``, and any gc on this store can tell when that
        sandbox is gone (:mod:`.pins`). Raises ImageNotFoundError if the image is gone (e.g.
        removed after get)."""
        _pins.pin(self._dir, digest, owner, home)

    def unpin(self, digest: str, owner: str) -> None:
        """Drop ``owner``'s pin; idempotent."""
        _pins.unpin(self._dir, digest, owner)

    def pins(self, digest: str) -> set[str]:
        return _pins.owners(self._dir, digest)

    def pin_list(self) -> builtins.list[_pins.Pin]:
        """Every pin in the store, with the home and writer a sandbox's pin names."""
        return list(_pins.listing(self._dir))

    def unpin_stale(self, present: _pins.Present, *, own_home: Path | None = None,
                    unknown: bool = False) -> builtins.list[_pins.Pin]:
        """Remove every pin :func:`.pins.stale` calls stale; returns them."""
        return [p for p in _pins.listing(self._dir)
                if _pins.stale(p, present, own_home=own_home, unknown=unknown)
                and _pins.unpin_if_stale(self._dir, p, present, own_home=own_home,
                                        unknown=unknown)]

    def usage(self) -> int:
        """Bytes used by all stored images (the number ``max_bytes`` is compared with)."""
        return sum(r.size_bytes for _, r in self._dir.image_records())

    def layer_refused(self, parent: str) -> str | None:
        """Why :meth:`add_layer` cannot add a layer on ``parent`` (None: it can)."""
        return layers.refused(self._dir, parent)

    def add_layer(self, ref: str, layout: Path, *, parent: str, build: Callable[[Path], None],
                  timeout: float = DEFAULT_PULL_TIMEOUT) -> Image:
        """Store the image that ``ref`` names (an ``oci:`` reference of ``layout``) as the
        stored image ``parent`` plus one layer of changes, with neither a copy nor an unpack:
        ``build(diff)`` writes the changes into the empty directory ``diff`` in overlayfs's
        form (:mod:`.layers`) and the layout at ``layout`` (the parent's layers and one
        more, so that other nodes and exports see an ordinary image). The image's rootfs is
        an overlay of ``diff`` on the parent's; the image keeps its parent stored. Raises
        what ``build`` raises; nothing is left behind."""
        parsed = parse_reference(ref)
        key = self._ref_key(parsed)
        deadline = time.monotonic() + timeout
        self._dir.make_dirs()
        try:
            with self._dir.locked(f"ref-{key}", deadline), \
                    self._dir.workdir(f"ref-{key}") as work:
                bundle = work / "image"
                bundle.mkdir(0o700)
                (bundle / "diff").mkdir(0o755)
                build(bundle / "diff")
                digest, config = _read_layout(layout)
                if not self.platform.matches(config.os, config.architecture, config.variant):
                    raise PlatformNotFoundError(f"image is {config.os}/{config.architecture}, "
                                                f"this store wants {self.platform}")
                with self._dir.locked(f"img-{_hex(digest)}", deadline):
                    if not (self._dir.image(digest) / "image.json").exists():
                        self._publish_layer(bundle, layout, digest, config, parent, deadline)
                record = _RefRecord(ref=str(parsed), platform=str(self.platform),
                                    digest=digest)
                staged = work / "ref.json"
                staged.write_text(record.model_dump_json())
                os.replace(staged, self._dir.ref_file(key))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"no space left in the image store {self.root}") from exc
            raise
        image = self._load(digest, ref=str(parsed), touch=True)
        if image is None:
            raise ImageNotFoundError(f"{ref} was removed while it was being added")
        eviction.evict(self._dir, self.max_bytes, keep=image.digest)
        return image

    def _publish_layer(self, bundle: Path, layout: Path, digest: str, config: ImageConfig,
                       parent: str, deadline: float) -> None:
        """Make ``bundle`` (holding ``diff/``) the stored image ``digest``; the caller holds
        its lock. The parent's pin and the rename happen under the parent's lock: a child is
        never published without its pin, nor is a pin without its child kept."""
        _link_tree(layout, bundle / "oci")
        for sub in ("rootfs", "pins"):
            (bundle / sub).mkdir()
        (bundle / "used").touch()
        record = _ImageRecord(digest=digest, config=config, size_bytes=_disk_usage(bundle),
                              created=time.time(), parent=parent)
        (bundle / "image.json").write_text(record.model_dump_json())
        with self._dir.locked(f"img-{_hex(parent)}", deadline):
            layers.pin_parent(self._dir, parent, digest)
            try:
                os.rename(bundle, self._dir.image(digest))
            except BaseException:
                layers.unpin_parent(self._dir, parent, digest)
                raise
        for blob in (self._dir.image(digest) / "oci" / "blobs" / "sha256").iterdir():
            try:
                os.link(blob, self._dir.blobs / blob.name)
            except FileExistsError:
                continue

    def _load(self, digest: str, *, ref: str, touch: bool) -> Image | None:
        """The stored image, its rootfs mounted if it is layered."""
        image = self._dir.load(digest, ref=ref, touch=touch)
        if image is not None and image.parent is not None:
            layers.ensure_mounted(self._dir, digest)
        return image

    def _get(
        self, ref: ImageRef, *, refetch: bool, fetch: bool, timeout: float,
        progress: Progress | None, network: PullNetwork = "node",
    ) -> Image:
        key = self._ref_key(ref)
        if not refetch and (image := self._lookup(ref, key)) is not None:
            return image
        if not fetch:
            raise ImageNotFoundError(f"{ref} is not in the image store (pull policy never)")
        # cheap, and survives an operator wiping the store under a live process
        self._dir.make_dirs()
        deadline = time.monotonic() + timeout
        with self._dir.locked(f"ref-{key}", deadline):
            # Whoever held the lock before us may have just fetched it.
            if not refetch and (image := self._lookup(ref, key) or
                                self._share_build(ref, key, deadline)) is not None:
                return image
            try:
                image = self._fetch(ref, key, deadline, progress or (lambda _: None), network)
            except RegistryUnreachableError as exc:
                raise RegistryUnreachableError(
                    f"{exc.message}. {_UNREACHABLE_HINT}", argv=exc.argv,
                    returncode=exc.returncode, stderr=exc.stderr) from None
        eviction.evict(self._dir, self.max_bytes, keep=image.digest)
        return image

    # -- lookups --------------------------------------------------------------------------

    def _ref_key(self, ref: ImageRef) -> str:
        return ref_key(str(ref), str(self.platform))

    def _lookup(self, ref: ImageRef, key: str) -> Image | None:
        record = self._dir.ref_record(key)
        if record is None or not _current(ref, record):
            return None
        return self._load(record.digest, ref=str(ref), touch=True)

    def _share_build(self, ref: ImageRef, key: str, deadline: float) -> Image | None:
        """Point ``ref`` at the current build of another tag of its recipe, if one is stored
        (``ray-sandbox/python:latest`` and ``:3.11``); the caller holds ref-<key>."""
        local = _local_image(ref)
        for other, entry in LOCAL_IMAGES.items():
            if other == str(ref) or local is None or entry.recipe != local.recipe:
                continue
            record = self._dir.ref_record(ref_key(other, str(self.platform)))
            if record is not None and record.source_digest == local.recipe and (
                image := self._point(ref, key, record.digest, local.recipe, deadline)
            ):
                return image
        return None

    def _point(self, ref: ImageRef, key: str, digest: str, source_digest: str | None,
               deadline: float) -> Image | None:
        """Make ``ref`` name the stored image ``digest``; None if it is not stored. The caller
        holds ref-<key>; the image lock keeps a removal from deleting it meanwhile."""
        with self._dir.locked(f"img-{_hex(digest)}", deadline):
            if not (self._dir.image(digest) / "image.json").exists():
                return None
            record = _RefRecord(ref=str(ref), platform=str(self.platform), digest=digest,
                                source_digest=source_digest)
            with self._dir.workdir(f"ref-{key}") as work:
                staged = work / "ref.json"
                staged.write_text(record.model_dump_json())
                os.replace(staged, self._dir.ref_file(key))
        return self._load(digest, ref=str(ref), touch=True)

    def _resolve_local(self, ref_or_digest: str) -> tuple[str, ImageRef | None]:
        """(digest, parsed reference) of a stored reference; (digest, None) for a digest."""
        text = ref_or_digest.strip()
        if re.fullmatch(r"(sha256:)?[0-9a-f]{64}", text):
            return (text if text.startswith("sha256:") else f"sha256:{text}"), None
        parsed = parse_reference(text)
        record = self._dir.ref_record(self._ref_key(parsed))
        if record is None:
            raise ImageNotFoundError(f"{parsed} is not in the image store")
        return record.digest, parsed

    # -- fetching -------------------------------------------------------------------------

    def _fetch(self, ref: ImageRef, key: str, deadline: float, progress: Progress,
               network: PullNetwork) -> Image:
        """Resolve, copy or build, verify, unpack and publish ``ref``; caller holds ref-<key>."""
        with ExitStack() as pulling:  # a "public" pull's namespace: until the copy is made
            skopeo = self._skopeo
            if ref.transport is Transport.DOCKER and network == "public":
                prefix = pulling.enter_context(_pull.isolated(_remaining(deadline)))
                skopeo = replace(skopeo, prefix=tuple(prefix))
            return self._fetch_with(skopeo, pulling, ref, key, deadline, progress)

    def _fetch_with(self, skopeo: Skopeo, pulling: ExitStack, ref: ImageRef, key: str,
                    deadline: float, progress: Progress) -> Image:
        resolved = None
        if ref.transport is Transport.DOCKER:
            progress(f"resolving {ref}")
            resolved = self._resolve(skopeo, ref, deadline)
            known = self._dir.ref_record(key)
            if known and known.source_digest == resolved.source_digest and (
                image := self._load(known.digest, ref=str(ref), touch=True)
            ):
                return image  # the tag did not move
        try:
            with self._dir.workdir(f"ref-{key}") as work:
                layout = work / "oci"
                try:
                    self._materialize(skopeo, ref, resolved, layout, work, deadline, progress)
                    pulling.close()  # nothing more to fetch
                    digest = self._ingest(layout, work, deadline, progress)
                except ImageError as exc:
                    # umoci can crash on a full disk without saying so ("panic: d.nx != 0"
                    # from a write that failed under its hashing reader): look at the disk
                    # before the failed work is removed and frees it
                    if isinstance(exc, StoreFullError) or not _nearly_full(work):
                        raise
                    raise StoreFullError(f"no space left in the image store {self.root}",
                                         argv=exc.argv, returncode=exc.returncode,
                                         stderr=exc.stderr) from exc
                local = _local_image(ref)
                source = resolved.source_digest if resolved else local.recipe if local else None
                record = _RefRecord(ref=str(ref), platform=str(self.platform), digest=digest,
                                    source_digest=source)
                staged = work / "ref.json"
                staged.write_text(record.model_dump_json())
                os.replace(staged, self._dir.ref_file(key))
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
        self, skopeo: Skopeo, ref: ImageRef, resolved: _Resolved | None, layout: Path,
        work: Path, deadline: float, progress: Progress,
    ) -> None:
        """Put ``ref`` as ``layout:image``: build a local image or copy it with skopeo."""
        if ref.transport is Transport.LOCAL:
            local = _local_image(ref)
            if local is None and ref.built_here:
                raise ImageNotFoundError(
                    f"{ref} is not built on this node: `ray-sandbox image build -t` names its "
                    "image on the node that built it (docs/docker.md, 'Dockerfile builds')")
            if local is None:
                raise ImageNotFoundError(f"no builder for {ref}; local images: "
                                         f"{sorted(LOCAL_IMAGES)}")
            progress(f"building {ref}")
            local.build(layout, _TAG, timeout=_remaining(deadline))
            return
        source = ref.source
        if resolved is not None:
            source = ref.at_digest(resolved.digest)  # exactly what was resolved
            self._prelink(layout, resolved.blobs)
        progress(f"copying {ref}")
        skopeo.copy(source, f"oci:{layout}:{_TAG}", timeout=_remaining(deadline),
                    src_tls_verify=not self._insecure(ref), tmpdir=work)

    def _insecure(self, ref: ImageRef) -> bool:
        host = ref.host or ""
        return is_loopback(host) or ref.registry in self.insecure_registries \
            or host in self.insecure_registries

    def _resolve(self, skopeo: Skopeo, ref: ImageRef, deadline: float) -> _Resolved:
        """Read the tag's manifest (one request) and pick the manifest for our platform."""
        tls = not self._insecure(ref)
        raw = skopeo.inspect_raw(ref.source, timeout=_remaining(deadline), tls_verify=tls)
        source_digest = _sha256(raw)
        top = _parse_manifest(raw, ref)
        if not top.is_index:
            return _Resolved(source_digest, source_digest, _blob_digests(top))
        for entry in top.manifests:
            p = entry.platform or {}
            if self.platform.matches(p.get("os", ""), p.get("architecture", ""), p.get("variant")):
                raw = skopeo.inspect_raw(ref.at_digest(entry.digest),
                                         timeout=_remaining(deadline), tls_verify=tls)
                return _Resolved(source_digest, entry.digest,
                                 _blob_digests(_parse_manifest(raw, ref)))
        offered = sorted({_platform_label(*((e.platform or {}).get(k) for k in
                                            ("os", "architecture", "variant")))
                          for e in top.manifests})
        raise PlatformNotFoundError(f"{ref} has no image for {self.platform}; it offers {offered}")

    def _prelink(self, layout: Path, digests: builtins.list[str]) -> None:
        """Hard-link blobs we already have into the new layout so skopeo skips downloading."""
        target = layout / "blobs" / "sha256"
        target.mkdir(parents=True, exist_ok=True)
        for digest in digests:
            try:
                os.link(self._dir.blobs / _hex(digest), target / _hex(digest))
            except (FileNotFoundError, FileExistsError, ImageReferenceError):
                continue

    def _ingest(self, layout: Path, work: Path, deadline: float, progress: Progress) -> str:
        """Verify the single image in ``layout`` and publish it unless already stored."""
        digest, config = _read_layout(layout)
        if not self.platform.matches(config.os, config.architecture, config.variant):
            found = _platform_label(config.os, config.architecture, config.variant)
            raise PlatformNotFoundError(f"image is {found}, this store wants {self.platform}")
        with self._dir.locked(f"img-{_hex(digest)}", deadline):
            target = self._dir.image(digest)
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
                    os.link(blob, self._dir.blobs / blob.name)
                except FileExistsError:
                    continue
        return digest
