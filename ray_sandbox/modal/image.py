"""Modal's ``Image``: a reference (``from_registry``, ``debian_slim``, ``from_id``, what
``snapshot_filesystem`` returns), or a reference plus steps of Modal's image DSL
(``apt_install``, ``pip_install``, ``uv_pip_install``, ``run_commands``, ``env``,
``workdir``, ``add_local_file``/``add_local_dir``, ``dockerfile_commands``, …) or a local
Dockerfile (``from_dockerfile``).

The steps become one Dockerfile, written here from Modal's documented meaning of each
method. Nothing is built when the image is defined: the first ``Sandbox.create(image=...)``
or ``image.build()`` builds it (``_build.py``: Docker inside a build sandbox under gVisor,
network ``public`` during the build only, cached by content), and the image object keeps
what it got. ``modal.enable_output()`` shows the build as it runs.

Sandboxes here never run an image's ``ENTRYPOINT`` or ``CMD`` (a sandbox's command runs as
given, as with ``entrypoint([])``), so steps that only set them (and ``shell``) need no
build on their own: ``Image.from_registry(tag).entrypoint([])`` is ``tag`` itself.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import secrets as _secrets
import shlex
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from ..runtime.errors import ModalInvalidError
from ..runtime.image_builders import PYTHON_IMAGES
from . import _build, output
from ._aio import dual, static
from ._options import DEFAULT_IMAGE, refuse
from ._refuse import refused, refused_property, refused_static

Ignore = Sequence[str] | Callable[[Path], bool]
_CTX = ".rsb"  # where the chain's local files go in the build context
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METADATA = ("ENTRYPOINT", "CMD")  # what sandboxes here never run: no build for it alone
_COPY_RE = re.compile(r"^\s*(COPY|ADD)\s+(.+)$", re.IGNORECASE)
_STEP_SECRETS = ("secrets= in an image build step: the build's environment is written "
                 "into the image's history here; pass build-time values with env= only "
                 "if they are not secret")


@dataclass(frozen=True)
class _File:
    """A local file or directory that goes into the build context at ``ctx``."""

    ctx: str
    local: str
    ignore: Ignore | None = None


@dataclass(frozen=True)
class _Recipe:
    base: str | None  # the FROM reference; None when ``dockerfile`` holds the start
    dockerfile: str | None = None  # from_dockerfile's text
    steps: tuple[str, ...] = ()  # Dockerfile lines after it
    files: tuple[_File, ...] = ()

    def needs_build(self) -> bool:
        return self.dockerfile is not None or any(
            step.split(None, 1)[0].upper() not in _METADATA for step in self.steps)

    def text(self) -> str:
        start = self.dockerfile if self.dockerfile is not None else f"FROM {self.base}\n"
        return start.rstrip("\n") + "\n" + "".join(f"{s}\n" for s in self.steps)


def _flat(items: Sequence[str | Sequence[str]]) -> list[str]:
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        else:
            out.extend(_flat(list(item)))
    return out


def _exports(env: Mapping[str, str | None] | None) -> str:
    """``export K=V && `` for a RUN step's build-time ``env=``."""
    pairs = []
    for key, value in (env or {}).items():
        if not _ENV_NAME.match(key):
            raise ModalInvalidError(f"env: {key!r} is not a variable name")
        if value is not None:
            pairs.append(f"{key}={shlex.quote(str(value))}")
    return f"export {' '.join(pairs)} && " if pairs else ""


def _step_options(what: str, *, secrets: Any = None, gpu: Any = None, volumes: Any = None,
                  force_build: bool = False) -> list[str]:
    """Refuse a build step's options that cannot be honoured; a ``force_build`` step gets a
    line of its own that makes the build new (Modal: skip the cache for it)."""
    if secrets:
        raise NotImplementedError(f"Image.{what}({_STEP_SECRETS})")
    refuse({"gpu": gpu, "volumes": volumes}, f"Image.{what}")
    return [f"# force_build {_secrets.token_hex(8)}"] if force_build else []


def _env_value(value: str) -> str:
    """A Dockerfile ``ENV`` value that means exactly ``value`` (no ``$`` expansion)."""
    return json.dumps(str(value)).replace("$", "\\$")


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


def _ignored(ignore: Ignore | None) -> Callable[[Path], bool]:
    """A predicate over paths relative to the directory added: a callable as given, or
    dockerignore-like patterns (``*.venv``, ``data/**``; a pattern matches a path or any of
    its parents)."""
    if ignore is None:
        return lambda _p: False
    if callable(ignore):
        return ignore
    patterns = [p.strip().rstrip("/") for p in ignore if p.strip() and not p.startswith("#")]

    def match(rel: Path) -> bool:
        parts = rel.as_posix().split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", ""))
                   for pat in patterns for p in prefixes)
    return match


def _copy_sources(lines: Sequence[str], context_dir: Path) -> list[_File]:
    """The local sources that a Dockerfile's COPY/ADD lines name, relative to
    ``context_dir`` (globs expanded; ``--from=`` stages and URLs are not local)."""
    out: dict[str, _File] = {}
    joined, pending = [], ""
    for line in lines:
        pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            joined.append(pending)
            pending = ""
    for line in joined:
        m = _COPY_RE.match(line)
        if not m:
            continue
        args = m.group(2).strip()
        if args.startswith("["):
            try:
                parts = [str(a) for a in json.loads(args)]
            except ValueError:
                continue
        else:
            parts = shlex.split(args)
        if any(p.startswith("--from") for p in parts):
            continue
        sources = [p for p in parts if not p.startswith("--")][:-1]
        for src in sources:
            if "://" in src:
                continue
            rel = PurePosixPath(src)
            if rel.is_absolute() or ".." in rel.parts:
                raise ModalInvalidError(f"COPY {src}: outside the build context {context_dir}")
            matches = sorted(context_dir.glob(str(rel))) if any(c in src for c in "*?[") \
                else [context_dir / rel]
            for path in matches:
                name = path.relative_to(context_dir).as_posix()
                if name in ("", "."):
                    name = "."
                if path.exists() or path.is_symlink():
                    out[name] = _File(name, str(path))
    return list(out.values())


class Image:
    """An image: a reference, or one with build steps (built on first use)."""

    def __init__(self, ref: str) -> None:
        self._recipe = _Recipe(base=ref)
        self._built: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def _of(cls, recipe: _Recipe) -> Image:
        image = cls.__new__(cls)
        image._recipe, image._built, image._lock = recipe, None, threading.Lock()
        return image

    def __repr__(self) -> str:
        r = self._recipe
        if not r.needs_build() and r.base is not None:
            return f"Image({r.base!r})"
        start = "from_dockerfile" if r.dockerfile is not None else r.base
        return f"Image({start!r} + {len(r.steps)} steps)"

    def _then(self, *steps: str, files: Sequence[_File] = ()) -> Image:
        r = self._recipe
        return Image._of(replace(r, steps=r.steps + steps, files=r.files + tuple(files)))

    def _ctx(self, local: str | os.PathLike[str], *, ignore: Ignore | None = None) -> _File:
        """Where a local file of the chain goes in the build context (one directory per
        file added, named by its position: the same chain makes the same context)."""
        path = Path(local).expanduser().absolute()
        if not path.exists():
            raise FileNotFoundError(f"{local}: no such local file or directory")
        return _File(f"{_CTX}/{len(self._recipe.files)}/{path.name}", str(path), ignore)

    # --- references --------------------------------------------------------------------------

    @property
    def ref(self) -> str:
        """The reference sandboxes start from: built first if the chain needs it."""
        return self._hydrate()

    @property
    def object_id(self) -> str:
        """The image's id (its reference; ``Image.from_id`` takes it back), built first if
        needed, as Modal hydrates an image when its id is asked for."""
        return self._hydrate()

    @static
    def from_registry(tag: str, secret: Any = None, *,
                      setup_dockerfile_commands: Sequence[str] = (), force_build: bool = False,
                      add_python: str | None = None, **options: Any) -> Image:
        """Any reference ray_sandbox pulls: a registry tag, ``oci:``, ``ray-sandbox/…``,
        ``localhost/NAME``. ``setup_dockerfile_commands`` become build steps."""
        refuse({"secret": secret, "add_python": add_python, "force_build": force_build,
                **options}, "Image.from_registry")
        return Image(tag)._then(*_flat(list(setup_dockerfile_commands)))

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

    @static
    def from_id(image_id: str, client: Any = None) -> Image:
        """The image whose ``object_id`` is ``image_id`` (a reference here)."""
        refuse({"client": client}, "Image.from_id")
        return Image(image_id)

    @static
    def from_scratch(force_build: bool = False) -> Image:
        """An empty image (``FROM scratch``): only files added with ``copy=True`` steps."""
        refuse({"force_build": force_build}, "Image.from_scratch")
        return Image("scratch")

    @static
    def from_dockerfile(path: str | os.PathLike[str], *, force_build: bool = False,
                        context_dir: str | os.PathLike[str] | None = None,
                        ignore: Ignore | None = None, build_args: Mapping[str, str] | None = None,
                        registry_secret: Any = None, secrets: Any = None,
                        env: Mapping[str, str | None] | None = None, gpu: Any = None,
                        add_python: str | None = None) -> Image:
        """The image a local Dockerfile builds (its ``FROM`` images from the node's image
        store). The files its ``COPY``/``ADD`` lines name are taken from ``context_dir``
        (default: the current directory), less ``ignore``; nothing else of that directory
        is sent (``.dockerignore`` files are not read)."""
        if build_args:
            raise NotImplementedError("Image.from_dockerfile(build_args=...): the builder takes "
                                      "no build arguments here; write the values into the "
                                      "Dockerfile (docs/compat.md)")
        if secrets:
            raise NotImplementedError(f"Image.from_dockerfile({_STEP_SECRETS})")
        if env:
            raise NotImplementedError("Image.from_dockerfile(env=...): write ENV lines into the "
                                      "Dockerfile (docs/compat.md)")
        refuse({"registry_secret": registry_secret, "gpu": gpu, "add_python": add_python},
               "Image.from_dockerfile")
        text = Path(path).read_text()
        root = Path(context_dir).expanduser().absolute() if context_dir is not None \
            else Path.cwd()
        keep = _ignored(ignore)
        files = [f for f in _copy_sources(text.splitlines(), root)
                 if f.ctx == "." or not keep(Path(f.ctx))]
        files = [replace(f, ignore=ignore) for f in files]
        forced = (f"# force_build {_secrets.token_hex(8)}",) if force_build else ()
        return Image._of(_Recipe(base=None, dockerfile=text, steps=forced, files=tuple(files)))

    # --- build steps -------------------------------------------------------------------------

    def apt_install(self, *packages: str | Sequence[str], force_build: bool = False,
                    env: Mapping[str, str | None] | None = None, secrets: Any = None,
                    gpu: Any = None) -> Image:
        """``apt-get install -y`` of Debian packages (the base's sources: Debian's mirror)."""
        pre = _step_options("apt_install", secrets=secrets, gpu=gpu, force_build=force_build)
        names = _flat(list(packages))
        if not names:
            return self
        quoted = " ".join(shlex.quote(p) for p in names)
        return self._then(*pre, f"RUN {_exports(env)}apt-get update && "
                          f"DEBIAN_FRONTEND=noninteractive apt-get install -y {quoted} && "
                          "rm -rf /var/lib/apt/lists/*")

    def _pip_flags(self, find_links: str | None, index_url: str | None,
                   extra_index_url: str | None, pre: str, extra_options: str) -> str:
        flags = [f"--find-links {shlex.quote(find_links)}" if find_links else "",
                 f"--index-url {shlex.quote(index_url)}" if index_url else "",
                 f"--extra-index-url {shlex.quote(extra_index_url)}" if extra_index_url else "",
                 pre, extra_options]
        return " ".join(f for f in flags if f)

    def pip_install(self, *packages: str | Sequence[str], find_links: str | None = None,
                    index_url: str | None = None, extra_index_url: str | None = None,
                    pre: bool = False, extra_options: str = "", force_build: bool = False,
                    env: Mapping[str, str | None] | None = None, secrets: Any = None,
                    gpu: Any = None) -> Image:
        """``python -m pip install`` of PyPI packages (the first ``python`` on PATH)."""
        prefix = _step_options("pip_install", secrets=secrets, gpu=gpu, force_build=force_build)
        names = _flat(list(packages))
        if not names:
            return self
        flags = self._pip_flags(find_links, index_url, extra_index_url,
                                "--pre" if pre else "", extra_options)
        quoted = " ".join(shlex.quote(p) for p in names)
        return self._then(*prefix, f"RUN {_exports(env)}python -m pip install --no-cache-dir "
                          f"{flags + ' ' if flags else ''}{quoted}")

    def pip_install_from_requirements(
        self, requirements_txt: str | os.PathLike[str], find_links: str | None = None, *,
        index_url: str | None = None, extra_index_url: str | None = None, pre: bool = False,
        extra_options: str = "", force_build: bool = False,
        env: Mapping[str, str | None] | None = None, secrets: Any = None, gpu: Any = None,
    ) -> Image:
        """``pip install -r`` of a local requirements file."""
        prefix = _step_options("pip_install_from_requirements", secrets=secrets, gpu=gpu,
                               force_build=force_build)
        f = self._ctx(requirements_txt)
        flags = self._pip_flags(find_links, index_url, extra_index_url,
                                "--pre" if pre else "", extra_options)
        inside = f"/{f.ctx}"
        return self._then(*prefix, f"COPY {f.ctx} {inside}",
                          f"RUN {_exports(env)}python -m pip install --no-cache-dir "
                          f"{flags + ' ' if flags else ''}-r {inside}", files=[f])

    def uv_pip_install(
        self, *packages: str | Sequence[str], requirements: Sequence[str] | None = None,
        find_links: str | None = None, index_url: str | None = None,
        extra_index_url: str | None = None, pre: bool = False, extra_options: str = "",
        force_build: bool = False, uv_version: str | None = None,
        env: Mapping[str, str | None] | None = None, secrets: Any = None, gpu: Any = None,
    ) -> Image:
        """``uv pip install --system`` (uv itself from PyPI when the image lacks it)."""
        prefix = [*_step_options("uv_pip_install", secrets=secrets, gpu=gpu,
                                 force_build=force_build)]
        names = _flat(list(packages))
        files = [self._ctx(r) for r in requirements or ()]
        files = [replace(f, ctx=f"{_CTX}/{len(self._recipe.files) + i}/{Path(f.local).name}")
                 for i, f in enumerate(files)]
        if not names and not files:
            return self
        uv = shlex.quote(f"uv=={uv_version}" if uv_version else "uv")
        flags = [f"--find-links {shlex.quote(find_links)}" if find_links else "",
                 f"--index-url {shlex.quote(index_url)}" if index_url else "",
                 f"--extra-index-url {shlex.quote(extra_index_url)}" if extra_index_url else "",
                 "--prerelease allow" if pre else "", extra_options,
                 *(f"--requirements /{f.ctx}" for f in files)]
        args = " ".join(x for x in [*flags, *(shlex.quote(p) for p in names)] if x)
        install_uv = (f"python -m pip install --no-cache-dir {uv}" if uv_version else
                      f"(command -v uv >/dev/null 2>&1 || python -m pip install --no-cache-dir "
                      f"{uv})")
        copies = [f"COPY {f.ctx} /{f.ctx}" for f in files]
        return self._then(*prefix, *copies, f"RUN {_exports(env)}{install_uv} && "
                          f"uv pip install --system --no-cache {args}", files=files)

    def run_commands(self, *commands: str | Sequence[str],
                     env: Mapping[str, str | None] | None = None, secrets: Any = None,
                     volumes: Any = None, gpu: Any = None, force_build: bool = False) -> Image:
        """Each command as its own ``RUN`` step (a shell command line)."""
        prefix = _step_options("run_commands", secrets=secrets, gpu=gpu, volumes=volumes,
                               force_build=force_build)
        cmds = _flat(list(commands))
        if not cmds:
            return self
        return self._then(*prefix, *(f"RUN {_exports(env)}{c}" for c in cmds))

    def dockerfile_commands(
        self, *dockerfile_commands: str | Sequence[str],
        context_files: Mapping[str, str] | None = None,
        env: Mapping[str, str | None] | None = None, secrets: Any = None, gpu: Any = None,
        context_dir: str | os.PathLike[str] | None = None, force_build: bool = False,
        ignore: Ignore | None = None, build_args: Mapping[str, str] | None = None,
    ) -> Image:
        """Dockerfile lines as written; the local files their ``COPY`` lines name come from
        ``context_dir`` (default: the current directory), ``context_files`` maps paths in
        the build context to local files."""
        prefix = _step_options("dockerfile_commands", secrets=secrets, gpu=gpu,
                               force_build=force_build)
        if build_args:
            raise NotImplementedError("Image.dockerfile_commands(build_args=...): the builder "
                                      "takes no build arguments here (docs/compat.md)")
        if env:
            raise NotImplementedError("Image.dockerfile_commands(env=...): write ENV lines "
                                      "(docs/compat.md)")
        lines = [line for c in _flat(list(dockerfile_commands)) for line in c.splitlines()]
        if not lines:
            return self
        root = Path(context_dir).expanduser().absolute() if context_dir is not None \
            else Path.cwd()
        keep = _ignored(ignore)
        files = [replace(f, ignore=ignore) for f in _copy_sources(lines, root)
                 if f.ctx == "." or not keep(Path(f.ctx))]
        for inside, local in (context_files or {}).items():
            rel = PurePosixPath(inside.lstrip("/"))
            if ".." in rel.parts or not rel.parts:
                raise ModalInvalidError(f"context_files: {inside!r} is not a path in the "
                                        "build context")
            if not Path(local).exists():
                raise FileNotFoundError(f"{local}: no such local file")
            files.append(_File(rel.as_posix(), str(Path(local).absolute())))
        return self._then(*prefix, *lines, files=files)

    def env(self, vars: Mapping[str, str]) -> Image:  # noqa: A002 - Modal's name
        """Environment variables of the image (``ENV``), taken literally."""
        for key in vars:
            if not _ENV_NAME.match(key):
                raise ModalInvalidError(f"Image.env: {key!r} is not a variable name")
        if not vars:
            return self
        return self._then("ENV " + " ".join(f"{k}={_env_value(v)}" for k, v in vars.items()))

    def workdir(self, path: str | PurePosixPath) -> Image:
        """The working directory of later steps and of the sandbox's commands."""
        return self._then(f"WORKDIR {json.dumps(str(path))}")

    def entrypoint(self, entrypoint_commands: Sequence[str]) -> Image:
        """``ENTRYPOINT``: kept in the image; a sandbox's command runs as given, without it."""
        return self._then(f"ENTRYPOINT {json.dumps(list(entrypoint_commands))}")

    def cmd(self, cmd: Sequence[str]) -> Image:
        """``CMD``: kept in the image; a sandbox runs the command it is created with."""
        return self._then(f"CMD {json.dumps(list(cmd))}")

    def shell(self, shell_commands: Sequence[str]) -> Image:
        """``SHELL`` of the later ``RUN`` steps."""
        return self._then(f"SHELL {json.dumps(list(shell_commands))}")

    def add_local_file(self, local_path: str | os.PathLike[str], remote_path: str, *,
                       copy: bool = False) -> Image:
        """A local file at ``remote_path`` (a path ending in ``/`` is a directory). Always
        built into the image here (Modal's ``copy=True``); ``copy=False`` differs only in
        that Modal adds the file at start."""
        f = self._ctx(local_path)
        if not Path(f.local).is_file():
            raise IsADirectoryError(f"{local_path}: not a file; use add_local_dir")
        remote = remote_path + Path(f.local).name if remote_path.endswith("/") else remote_path
        return self._then(f"COPY {f.ctx} {json.dumps(remote)}", files=[f])

    def add_local_dir(self, local_path: str | os.PathLike[str], remote_path: str, *,
                      copy: bool = False, ignore: Ignore = ()) -> Image:
        """A local directory's contents at ``remote_path``, less what ``ignore`` matches
        (patterns, or a predicate over paths relative to the directory). Built into the
        image here, as ``add_local_file``."""
        f = self._ctx(local_path, ignore=ignore or None)
        if not Path(f.local).is_dir():
            raise NotADirectoryError(f"{local_path}: not a directory; use add_local_file")
        return self._then(f"COPY {f.ctx} {json.dumps(remote_path)}", files=[f])

    def copy_local_file(self, local_path: str | os.PathLike[str],
                        remote_path: str = "./") -> Image:
        """Modal before 1.0: ``add_local_file(..., copy=True)``."""
        return self.add_local_file(local_path, remote_path, copy=True)

    def copy_local_dir(self, local_path: str | os.PathLike[str], remote_path: str = ".",
                       ignore: Ignore = ()) -> Image:
        """Modal before 1.0: ``add_local_dir(..., copy=True)``."""
        return self.add_local_dir(local_path, remote_path, copy=True, ignore=ignore)

    def pipe(self, func: Callable[..., Image], *args: Any, **kwargs: Any) -> Image:
        return func(self, *args, **kwargs)

    # --- building ----------------------------------------------------------------------------

    @dual
    def build(self, app: Any = None) -> Image:
        """Build it now (once; cached by content on the node); returns the image."""
        self._hydrate()
        return self

    @dual
    def hydrate(self, client: Any = None) -> Image:
        refuse({"client": client}, "Image.hydrate")
        self._hydrate()
        return self

    def _hydrate(self) -> str:
        r = self._recipe
        if not r.needs_build():
            if r.base == "scratch":
                raise ModalInvalidError("Image.from_scratch(): an empty image; add files "
                                        "with add_local_file/add_local_dir first")
            return r.base  # type: ignore[return-value]
        with self._lock:
            if self._built is None:
                if r.base is not None and r.base.startswith("oci:"):
                    raise NotImplementedError(
                        f"build steps on {r.base}: a filesystem image cannot be a Dockerfile's "
                        "FROM here; add the steps before snapshot_filesystem() (docs/compat.md)")
                with tempfile.TemporaryDirectory(prefix="rsb-modal-ctx-") as tmp:
                    ctx = Path(tmp)
                    for f in r.files:
                        _place(f, ctx)
                    self._built = _build.build(r.text(), ctx, output.show)
            return self._built

    @contextlib.contextmanager
    def imports(self) -> Iterator[None]:
        """Imports that only work where the image runs: an ImportError here is ignored (a
        sandbox's code imports inside the sandbox)."""
        try:
            yield
        except ImportError:
            pass

    # --- what is not here --------------------------------------------------------------------

    _NO_PLATFORM = "Modal's platform feature, not part of ray_sandbox.modal's sandboxes"
    from_name = refused_static("Image.from_name", "there is no image registry of names here; "
                               "use Image.from_registry('localhost/NAME') for a build")
    from_aws_ecr = refused_static("Image.from_aws_ecr", "no registry credentials here; pull "
                                  "it with skopeo's auth file (docs/images.md)")
    from_gcp_artifact_registry = refused_static(
        "Image.from_gcp_artifact_registry", "no registry credentials here; pull it with "
        "skopeo's auth file (docs/images.md)")
    micromamba = refused_static("Image.micromamba", "no micromamba base image here; use "
                                "debian_slim() or from_registry()")
    micromamba_install = refused("Image.micromamba_install", "no micromamba here; use "
                                 "run_commands")
    pip_install_from_pyproject = refused("Image.pip_install_from_pyproject",
                                         "use pip_install or run_commands")
    pip_install_private_repos = refused("Image.pip_install_private_repos",
                                        "no git credentials here; use run_commands")
    poetry_install_from_file = refused("Image.poetry_install_from_file",
                                       "use add_local_dir(copy=True) and run_commands")
    uv_sync = refused("Image.uv_sync", "use add_local_dir(copy=True) and run_commands")
    run_function = refused("Image.run_function", "runs a Modal Function: " + _NO_PLATFORM)
    add_local_python_source = refused("Image.add_local_python_source",
                                      "use add_local_dir(local_path, remote_path)")
    publish = refused("Image.publish", "there is no image registry of names here")
    get_dashboard_url = refused("Image.get_dashboard_url", "no dashboard for images here")
    logs = refused_property("Image.logs", "a build's output shows under "
                            "modal.enable_output()")


def _place(f: _File, ctx: Path) -> None:
    """Copy a local file or directory of the chain into the build context (a directory's
    ignored paths left out)."""
    dest = ctx / f.ctx if f.ctx != "." else ctx
    src = Path(f.local)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir() and not src.is_symlink():
        skip = _ignored(f.ignore)

        def ignored(directory: str, names: list[str]) -> set[str]:
            rel = Path(directory).relative_to(src)
            return {n for n in names if skip(rel / n)}
        shutil.copytree(src, dest, symlinks=True, ignore=ignored, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dest, follow_symlinks=False)

__all__ = ["Image"]
