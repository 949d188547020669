"""The only place that builds ``skopeo`` command lines: copy images between transports and read
raw manifests. Failures are classified from skopeo's stderr into the ImageError tree."""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import _proc
from .errors import (
    ImageCorruptError,
    ImageError,
    ImageNotFoundError,
    PlatformNotFoundError,
    RegistryAuthError,
    RegistryUnreachableError,
    StoreFullError,
)

# First match wins: a full disk or a platform miss can mention "not found"-like words too.
_RULES: tuple[tuple[re.Pattern[str], type[ImageError]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cls)
    for pattern, cls in (
        (r"no space left on device|disk quota exceeded", StoreFullError),
        (r"no image found in (manifest list|image index)", PlatformNotFoundError),
        (
            r"unauthorized|requested access to the resource is denied|authentication required"
            r"|invalid username/password",
            RegistryAuthError,
        ),
        (
            r"connection refused|no such host|i/o timeout|network is unreachable|no route to host"
            r"|server gave HTTP response to HTTPS client|TLS handshake|connection reset",
            RegistryUnreachableError,
        ),
        (
            r"digest did not match|digest mismatch|unexpected EOF|invalid tar header"
            r"|gzip: invalid header|invalid checksum|invalid character",
            ImageCorruptError,
        ),
        (
            r"manifest unknown|name unknown|no descriptor found|not found"
            r"|no such file or directory",
            ImageNotFoundError,
        ),
    )
)


# uname -m spellings -> OCI architecture names.
ARCH_ALIASES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}


def host_architecture() -> str:
    """This machine's architecture as OCI images name it (``amd64``, ``arm64``, …)."""
    return ARCH_ALIASES.get(platform.machine(), platform.machine())


def classify(returncode: int, stderr: str) -> type[ImageError]:
    """Map a failed skopeo run to the ImageError subclass its stderr describes."""
    return next((cls for pattern, cls in _RULES if pattern.search(stderr)), ImageError)


_MSG = re.compile(r'msg="((?:[^"\\]|\\.)*)"')
_REASON_CHARS = 500  # a registry's words reach the message: bounded


def reason(stderr: str) -> str:
    """Why skopeo failed, in its own words: the ``msg`` of its last log line (unescaped,
    without the "Error parsing image name" preamble our message already says), else its
    last line of stderr."""
    found = _MSG.findall(stderr)
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    text = re.sub(r'\\(.)', r"\1", found[-1]) if found else (lines[-1] if lines else "")
    text = re.sub(r'^Error parsing image name "[^"]*": ', "", text)
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def _bool(flag: str, value: bool) -> str:
    return f"{flag}={'true' if value else 'false'}"


@dataclass(frozen=True)
class Skopeo:
    """skopeo with this node's platform choice and credentials applied to every call."""

    os: str = "linux"
    arch: str = field(default_factory=host_architecture)
    variant: str | None = None
    authfile: Path | None = None
    prefix: tuple[str, ...] = ()  # runs skopeo elsewhere, e.g. in a pull's network namespace

    def _argv(self, tmpdir: Path | None, verb: str, *args: str) -> list[str]:
        argv = [*self.prefix, "skopeo", "--override-os", self.os, "--override-arch", self.arch]
        if self.variant:
            argv += ["--override-variant", self.variant]
        if tmpdir is not None:  # archives are unpacked here, not in /var/tmp
            argv += ["--tmpdir", str(tmpdir)]
        return [*argv, verb, *args]

    def _auth(self) -> list[str]:
        return ["--authfile", str(self.authfile)] if self.authfile is not None else []

    def copy(
        self,
        src: str,
        dest: str,
        *,
        timeout: float,
        src_tls_verify: bool = True,
        dest_tls_verify: bool = True,
        all_images: bool = False,
        tmpdir: Path | None = None,
    ) -> None:
        """``skopeo copy SRC DEST`` (one platform unless ``all_images``)."""
        args = ["--quiet", _bool("--src-tls-verify", src_tls_verify),
                _bool("--dest-tls-verify", dest_tls_verify), *self._auth()]
        if all_images:
            args.append("--all")
        _run(self._argv(tmpdir, "copy", *args, src, dest), timeout, f"skopeo copy {src}")

    def inspect_raw(self, src: str, *, timeout: float, tls_verify: bool = True) -> bytes:
        """The manifest (or image index) of ``src`` exactly as stored, for digesting."""
        args = ["--raw", _bool("--tls-verify", tls_verify), *self._auth()]
        return _run(self._argv(None, "inspect", *args, src), timeout,
                    f"skopeo inspect {src}").stdout


def _run(argv: list[str], timeout: float, what: str) -> _proc.Completed:
    """A failure raises the ImageError its stderr describes, with skopeo's reason in the
    message (the service and the Ray layer show the message, not the stderr)."""
    done = _proc.run(argv, timeout=timeout, check=False, what=what)
    if done.returncode != 0:
        why = reason(done.stderr)
        raise classify(done.returncode, done.stderr)(
            f"{what} failed: {why}" if why else f"{what} failed", argv=argv,
            returncode=done.returncode, stderr=done.stderr)
    return done
