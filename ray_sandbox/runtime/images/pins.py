"""Pins: what keeps an image in the store while a sandbox uses it, and how any process on the
store tells a pin whose sandbox is gone.

A pin is the file ``sha256/<hex>/pins/<owner>``; a pinned image is never evicted, pruned or
removed. A sandbox's pin is owned by ``<key>:<sandbox id>``, where ``key`` is
:func:`home_key` of the sandbox's home (its state directory), so several homes share one store
without taking each other's pins. The file holds, as JSON, the home's resolved path and the
process that wrote the pin (pid and start time), so that a process of any home can check the
pin (:func:`stale`):

- the home still has the sandbox (``present(home, id)``: its directory, or its tombstone while
  a teardown is pending): the pin holds, whatever the state of the sandbox. Whether that
  sandbox should still exist is its own home's gc to judge; that gc destroys it, and the
  teardown unpins.
- otherwise the pin is stale, unless a create may be in flight: a create pins its image
  before it makes the sandbox directory (the image is fetched first, and a directory without
  a record older than ``records.CREATING_GRACE_S`` would be taken for a dead create). So a
  pin younger than ``GRACE_S`` whose writer still runs is kept. That window is the few
  statements between the pin and the ``mkdir`` (a restore settles a previous sandbox of its
  id before pinning, so no wait falls in it); ``GRACE_S`` is a margin for a stalled process,
  not a timing the code relies on. A pin whose writer died has nothing in flight and is
  stale at once. A grace period rather than the directory first: the directory would then
  exist during a pull of any length and be reaped as a dead create.
- the final check and the unlink run under the image's lock (``img-<hex>``), which
  :func:`pin` also holds, so a pin rewritten meanwhile (an id used again) is never removed.

Pins written before pins named their home are empty files: their home is unknown. A runtime
knows its own home's key, so its gc judges those of its own home (with the grace period,
their writer being unknown); pins of a home whose runtime never runs again stay, and
``doctor`` counts them. ``stale(..., unknown=True)`` (``ray-sandbox gc --unknown-pins``) also
takes those older than ``GRACE_S`` whose sandbox's home no process can name: only for a store
that no runtime of an older version uses. Pins of other owners (any name not
``<12 hex>:<32 hex>``, e.g. a user's own ``pin(digest, "mine")``) are never judged.

Limit: the home's path is looked up in the checking process's mount namespace, so every
process using a store must see the homes that share it at their paths (one node's mount
namespace). Pods in mount namespaces of their own whose homes have the same path share one
key and cannot be told apart: give each home its own path or its own store (docs/images.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from .. import procfs
from ..errors import ConfigError, ImageBusyError, ImageNotFoundError
from .reference import _hex
from .storedir import StoreDir

OWNER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,199}$")
SANDBOX_OWNER = re.compile(r"^([0-9a-f]{12}):([0-9a-f]{32})$")
GRACE_S = 60.0
_CONTENT_MAX = 8192  # a home path (PATH_MAX 4096) and two integers, as JSON
_LOCK_S = 60.0


def home_key(home: Path) -> str:
    """The 12 hex characters that name ``home`` in its sandboxes' pins."""
    return _key(str(home.resolve()))


def _key(resolved: str) -> str:
    return hashlib.sha256(resolved.encode()).hexdigest()[:12]


class Pin(NamedTuple):
    """One pin as found on disk."""

    digest: str
    owner: str
    mtime: float
    key: str | None = None  # a sandbox's pin: its home's key and its id
    sandbox_id: str | None = None
    home: Path | None = None  # the home the pin names (None: an old pin, or not a sandbox's)
    writer_pid: int | None = None
    writer_start: int | None = None


def pin(store_dir: StoreDir, digest: str, owner: str, home: Path | None = None) -> None:
    """Write ``owner``'s pin (again: its time and writer are renewed). With ``home``, the pin
    names that home and this process; ``owner`` must then be ``<home_key(home)>:<id>``."""
    if not OWNER_RE.match(owner):
        raise ConfigError(f"pin owner must match {OWNER_RE.pattern}, got {owner!r}")
    content = b""
    if home is not None:
        resolved = str(home.resolve())
        if not owner.startswith(f"{_key(resolved)}:"):
            raise ConfigError(f"pin owner {owner!r} does not start with its home's key "
                              f"{_key(resolved)} ({resolved})")
        me = procfs.stat(os.getpid())
        content = json.dumps({"home": resolved, "pid": os.getpid(),
                              "start": me.start if me else None}).encode()
    with store_dir.locked(f"img-{_hex(digest)}", time.monotonic() + _LOCK_S):
        pin_dir = store_dir.image(digest) / "pins"
        if not pin_dir.is_dir():
            raise ImageNotFoundError(f"{digest} is not in the image store")
        fd = os.open(pin_dir / owner, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, content)
            os.utime(fd)  # renewed even where the content did not change
        finally:
            os.close(fd)


def unpin(store_dir: StoreDir, digest: str, owner: str) -> None:
    if OWNER_RE.match(owner):
        (store_dir.image(digest) / "pins" / owner).unlink(missing_ok=True)


def owners(store_dir: StoreDir, digest: str) -> set[str]:
    try:
        return set(os.listdir(store_dir.image(digest) / "pins"))
    except FileNotFoundError:
        return set()


def read(store_dir: StoreDir, digest: str, owner: str) -> Pin | None:
    """The pin as it is on disk now, None if it is gone. Content that does not parse, or that
    names a home whose key is not the owner's, leaves the home unknown."""
    path = store_dir.image(digest) / "pins" / owner
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:  # a link in place of a pin: nothing we wrote, never judged
        return Pin(digest, owner, time.time())
    try:
        mtime = os.fstat(fd).st_mtime
        raw = os.read(fd, _CONTENT_MAX)
    except OSError:  # e.g. a directory: never judged
        return Pin(digest, owner, time.time())
    finally:
        os.close(fd)
    match = SANDBOX_OWNER.match(owner)
    if match is None:
        return Pin(digest, owner, mtime)
    key, sandbox_id = match.groups()
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = {}
    home, pid, start = data.get("home"), data.get("pid"), data.get("start")
    if not isinstance(home, str) or _key(home) != key:
        return Pin(digest, owner, mtime, key, sandbox_id)
    return Pin(digest, owner, mtime, key, sandbox_id, Path(home),
               pid if isinstance(pid, int) else None, start if isinstance(start, int) else None)


def listing(store_dir: StoreDir) -> Iterator[Pin]:
    """Every pin in the store."""
    for digest in store_dir.digests():
        for owner in sorted(owners(store_dir, digest)):
            if (found := read(store_dir, digest, owner)) is not None:
                yield found


Present = Callable[[Path, str], bool]


def stale(p: Pin, present: Present, *, own_home: Path | None = None, unknown: bool = False,
          now: float | None = None) -> bool:
    """Whether ``p`` pins for a sandbox that no longer exists and no create is making
    (module docstring). ``present(home, sandbox_id)`` says whether the home still has the
    sandbox; ``own_home`` names the home of old pins with this home's key."""
    if p.key is None or p.sandbox_id is None:
        return False  # not a sandbox's pin
    age = (time.time() if now is None else now) - p.mtime
    home = p.home
    if home is None and own_home is not None and home_key(own_home) == p.key:
        home = own_home
    if home is None:
        return unknown and age >= GRACE_S
    if present(home, p.sandbox_id):
        return False
    in_flight = p.writer_pid is None or procfs.is_running(p.writer_pid, p.writer_start)
    return not (in_flight and age < GRACE_S)


def unpin_if_stale(store_dir: StoreDir, p: Pin, present: Present, *,
                   own_home: Path | None = None, unknown: bool = False) -> bool:
    """Remove ``p`` if, read again under the image's lock, it is still :func:`stale`.
    False if it holds, or the lock is busy (the next gc tries again)."""
    try:
        with store_dir.locked(f"img-{_hex(p.digest)}", time.monotonic() + 1.0):
            again = read(store_dir, p.digest, p.owner)
            if again is None or not stale(again, present, own_home=own_home, unknown=unknown):
                return False
            (store_dir.image(p.digest) / "pins" / p.owner).unlink(missing_ok=True)
            return True
    except ImageBusyError:
        return False
