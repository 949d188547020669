"""Secrets for credential injection, and the header templates that name their keys.

A sandbox's egress policy may ask the node's egress proxy to set headers on its HTTPS
requests (``EgressPolicy.inject``, docs/network.md "Credential injection"); a header value
is a template naming keys of one secret: ``Bearer $API_TOKEN``, ``${KEY}``, ``$$`` for a
literal ``$``. The values live here, on the node, and never in the sandbox, its record or
its config. :class:`SecretStore` is a root-only directory, ``<home>/secrets/`` for a
runtime (``rt.secrets``):

    <name>              one secret: JSON {"KEY": "value", ...}, mode 0600
    <scope>/<name>      a secret of a scope: the service keeps each tenant's in its own, and
                        a tenant can name no other (service/_policy.py)

The proxy reads a secret at every request that needs it, so ``put`` applies to the next
request and ``delete`` stops injection at once. Pure standard library: the per-sandbox
network helper imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from .errors import ConfigError

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
NAME_RE = re.compile(rf"^{_SEGMENT}(/{_SEGMENT})?$")
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}$")  # an RFC 9110 field name
_PLACEHOLDER_RE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]{0,127})\}|"
                             r"([A-Za-z_][A-Za-z0-9_]{0,127}))")
MAX_KEYS = 64  # per secret
MAX_VALUE = 8192  # bytes of one value, and of one rendered header
MAX_HEADERS = 32  # per domain
MAX_FILE = 1 << 20  # what the proxy reads of one secret file
# In the state directory of a sandbox that injects (its directory on the host, never mounted
# whole): the certificate of its proxy's CA, which its trust bundle adds, and the CA's key.
CA_FILE = "inject-ca.pem"
CA_KEY_FILE = "inject-ca-key.pem"
# Headers that frame or route a message: setting them would let a rule, or a sandbox through
# one, desynchronise the proxy and the upstream (request smuggling) or move the request.
FORBIDDEN_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
    "te", "trailer", "expect", "proxy-connection", "proxy-authorization",
})  # fmt: skip


def check_name(name: str) -> str:
    """A secret's name: 1-64 of ``A-Za-z0-9_.-`` starting with a letter or digit, with at
    most one ``scope/`` in front."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"secret name {name!r}: 1-64 of A-Za-z0-9_.- starting with a letter "
                         "or digit, optionally scope/name")
    return name


def _check_text(text: str, what: str) -> None:
    if any(c != "\t" and (c < " " or c == "\x7f") for c in text):
        raise ValueError(f"{what} holds a control character (CR, LF, NUL, ...)")
    if len(text.encode()) > MAX_VALUE:
        raise ValueError(f"{what} is longer than {MAX_VALUE} bytes")


def check_values(values: Mapping[str, str]) -> dict[str, str]:
    """A secret's keys and values: names like environment variables, values that fit into a
    header (no control characters, at most 8 KiB), at most 64 keys."""
    if not isinstance(values, Mapping) or not values or len(values) > MAX_KEYS:
        raise ValueError(f"a secret is a mapping of 1-{MAX_KEYS} keys to strings")
    for k, v in values.items():
        if not isinstance(k, str) or not KEY_RE.match(k):
            raise ValueError(f"secret key {k!r}: a letter or _, then letters, digits or _")
        if not isinstance(v, str):
            raise ValueError(f"secret key {k}: the value must be a string")
        _check_text(v, f"the value of {k}")
    return dict(values)


def placeholders(template: str) -> list[str]:
    """The keys ``template`` names; ValueError on a ``$`` that starts none."""
    keys, pos = [], 0
    for m in _PLACEHOLDER_RE.finditer(template):
        if "$" in template[pos : m.start()]:
            break
        pos = m.end()
        if not m.group(1):
            keys.append(m.group(2) or m.group(3))
    if "$" in template[pos:]:
        raise ValueError(f"template {template!r}: a $ must start $KEY, ${{KEY}} or $$")
    return keys


def check_header(name: str, template: str) -> list[str]:
    """Validate one header of a rule; returns the secret keys its value names."""
    if not isinstance(name, str) or not _TOKEN_RE.match(name):
        raise ValueError(f"header name {name!r} is not an HTTP field name")
    if name.lower() in FORBIDDEN_HEADERS or name.lower().startswith("proxy-"):
        raise ValueError(f"header {name!r} frames or routes the request; it cannot be set")
    if not isinstance(template, str):
        raise ValueError(f"header {name}: the value must be a string")
    _check_text(template, f"header {name}")
    return placeholders(template)


def render(template: str, values: Mapping[str, str]) -> str:
    """``template`` with its keys replaced by ``values``; KeyError names a missing key."""

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        return values[m.group(2) or m.group(3)]

    return _PLACEHOLDER_RE.sub(one, template)


class SecretStore:
    """Named secrets on this node (see the module docstring), in the directory ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def of_home(cls, home: str | Path) -> SecretStore:
        """The store of the runtime whose home is ``home``: ``<home>/secrets``."""
        return cls(Path(home) / "secrets")

    def _path(self, name: str) -> Path:
        try:
            return self.root / check_name(name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def put(self, name: str, values: Mapping[str, str]) -> None:
        """Create or replace the secret ``name`` (atomic: a request reads the old or the new
        one, never a mix)."""
        path = self._path(name)
        try:
            data = json.dumps(check_values(values)).encode()
        except ValueError as exc:
            raise ConfigError(f"secret {name}: {exc}") from None
        for d in (self.root, path.parent):
            d.mkdir(mode=0o700, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise ConfigError(f"{d} is not a directory")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, name: str) -> dict[str, str] | None:
        """The secret's values, or None if there is none (or it cannot be read)."""
        return read(self.root, name)

    def delete(self, name: str) -> bool:
        """Remove the secret; whether it existed. Requests after this get no value."""
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        if path.parent != self.root:
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # an empty scope
        return True

    def names(self, scope: str | None = None) -> list[str]:
        """The names of the store's secrets (of ``scope`` only, if given), sorted."""
        base = self.root if scope is None else self.root / check_name(scope)
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_file(follow_symlinks=False):
                out.append(e.name if scope is None else f"{scope}/{e.name}")
            elif scope is None and e.is_dir(follow_symlinks=False):
                out += self.names(e.name)
        return sorted(out)


def read(root: str | Path, name: str) -> dict[str, str] | None:
    """The values of secret ``name`` under ``root``, or None: not there, not a regular file
    (never through a link), larger than 1 MiB, or not a valid secret."""
    try:
        check_name(name)
        fd = os.open(Path(root) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (ValueError, OSError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_FILE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return check_values(json.loads(data)) if len(data) <= MAX_FILE else None
    except ValueError:
        return None
