"""Image pulls that reach only public addresses (``pull_network="public"``, docs/images.md).

skopeo follows a registry's auth realm and its redirects wherever they point, and resolves
every name again when it connects: a check of the reference before the pull holds nothing
(docs/security.md, "Tenants of the service"). Here the kernel decides each connection. The
pull runs in a network namespace of its own, attached like a ``public`` sandbox's
(:mod:`._lifecycle`): slirp4netns is its only way out, without the node's loopback, and the
``public`` mode's nft table refuses the never tier (loopback, link-local, multicast, reserved,
every address of the node), the private tier and the veth pool, after every redirect and every
resolution alike. Its own loopback holds nothing but its DNS helper, which forwards to the
node's resolvers (:func:`resolvers`), so a name resolves inside the namespace and its answer is
filtered like any address.

One namespace per pull, made when the pull starts and removed when it ends (it costs tens of
milliseconds against seconds of pulling; docs/images.md). Each has a directory
``<node dir>/pulls/<id>/`` whose ``owner`` file names the process (PID and start time) that
pulls; :func:`reap` removes the namespaces of processes that are gone, with whatever still
runs inside them, at the start of every isolated pull and in a runtime's gc.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import procfs
from ..config import SandboxConfig
from ..errors import ConfigError, NetworkError, SandboxError
from . import _lifecycle, alloc, dns, procs
from . import netns as _netns
from .settings import node_dir, settings, tag

MAX_PULLS = 8  # isolated pulls of one process at once: each has two helper processes
_OWNER = "owner"
_RESOLV = "resolv.conf"
_NEW = ".new"  # a directory being made: its owner file is written before it is renamed
# A proxy relays connections to wherever it reaches: the namespace's filter would see only
# the proxy's address, so a pull in it uses none (Go reads these; ALL_PROXY for other tools).
PROXY_VARIABLES = tuple(v for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
                        for v in (name, name.lower()))
_slots = threading.BoundedSemaphore(MAX_PULLS)
_log = logging.getLogger(__name__)


def pulls_dir() -> Path:
    return node_dir() / "pulls"


@contextmanager
def isolated(timeout: float) -> Iterator[list[str]]:
    """A network namespace for one pull. Yields the argv prefix that runs a command in it,
    with a /etc/resolv.conf naming its resolver and no proxy; everything is removed on exit.
    Waits up to ``timeout`` seconds while :data:`MAX_PULLS` pulls of this process run."""
    if os.geteuid() != 0:
        raise ConfigError("pull_network='public' needs root on this node")
    if not _slots.acquire(timeout=max(0.0, timeout)):
        raise NetworkError(f"{MAX_PULLS} isolated pulls of this process are running; none "
                           f"ended within {timeout:g} s")
    try:
        reap()
        pull_id, state = _make_dir()
        try:
            att = _lifecycle.attach(pull_id, SandboxConfig(network="public", dns=resolvers()),
                                    state)
            (state / _RESOLV).write_text(att.resolv_conf or "")
            unset = [a for v in PROXY_VARIABLES for a in ("-u", v)]
            yield [*_netns.enter_with_resolv(tag(pull_id), state / _RESOLV), "env", *unset]
        finally:
            _remove(pull_id, state)
    finally:
        _slots.release()


def resolvers() -> tuple[str, ...]:
    """Where an isolated pull's names are resolved: ``RAY_SANDBOX_NET_PULL_DNS``, else the
    nameservers of the node's /etc/resolv.conf (those a pull on the node's network asks),
    else :data:`.dns.DEFAULT_UPSTREAMS`. The helper asks them from the upstream namespace."""
    node = settings()
    if node.pull_dns:
        return node.pull_dns
    try:
        text = Path("/etc/resolv.conf").read_text()
    except OSError:
        text = ""
    found: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                found.append(str(ipaddress.ip_address(words[1])))
            except ValueError:
                continue  # a scoped or garbled entry: the others serve
    return tuple(found[:3]) or dns.DEFAULT_UPSTREAMS  # glibc reads three


def _make_dir() -> tuple[str, Path]:
    """A new pull's directory, with its owner file in place before it has its name (so
    :func:`reap` never takes a pull that is being made for a dead one)."""
    base = pulls_dir()
    base.mkdir(parents=True, exist_ok=True)
    pull_id = secrets.token_hex(16)
    new = base / (pull_id + _NEW)
    new.mkdir(mode=0o700)
    st = procfs.stat(os.getpid())
    (new / _OWNER).write_text(f"{os.getpid()} {st.start if st else 0}\n")
    state = base / pull_id
    os.rename(new, state)
    return pull_id, state


def _owner_alive(state: Path) -> bool:
    try:
        pid, start = map(int, (state / _OWNER).read_text().split())
    except (OSError, ValueError):
        return False
    st = procfs.stat(pid)
    return st is not None and st.start == start and st.state != "Z"


def _remove(pull_id: str, state: Path) -> bool:
    """Detach the pull's network and drop its directory; on a failure the owner file goes
    instead, so the next :func:`reap` tries again."""
    try:
        _lifecycle.detach(pull_id, state)
    except SandboxError as exc:
        (state / _OWNER).unlink(missing_ok=True)
        _log.warning("isolated pull %s: teardown incomplete, left to gc: %s", pull_id, exc)
        return False
    shutil.rmtree(state, ignore_errors=True)
    return True


def _kill_inside(name: str) -> None:
    """Stop every process still in netns ``name``: a dead puller's skopeo."""
    try:
        ns = os.stat(_netns.netns_path(name))
    except OSError:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ns.st_dev, ns.st_ino):
            procs.kill_tagged(int(entry.name))


def reap() -> list[str]:
    """Remove the namespace, helpers, processes, lease and directory of every isolated pull
    on the node whose process is gone; returns their ids. Pulls of live processes, of any
    home, are left alone."""
    base = pulls_dir()
    recorded = alloc.read()
    ids = recorded.sandbox_ids(alloc.owner(base))
    names = [p.name for p in base.iterdir()] if base.is_dir() else []
    removed: list[str] = []
    for name in names:
        if name.endswith(_NEW) and not _owner_alive(base / name):
            shutil.rmtree(base / name, ignore_errors=True)  # died before it had a namespace
    for pull_id in sorted(ids | {n for n in names if not n.endswith(_NEW)}):
        state = Path(recorded.state_dirs.get(pull_id, base / pull_id))
        if _owner_alive(state):
            continue
        try:
            _kill_inside(tag(pull_id))
        except (SandboxError, OSError):
            continue  # not a pull's name: nothing of ours to remove
        if _remove(pull_id, state):
            removed.append(pull_id)
    return removed


def leftovers() -> list[str]:
    """The isolated pulls' directories on the node (none once every pull has ended)."""
    base = pulls_dir()
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []
