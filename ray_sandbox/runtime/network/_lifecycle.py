"""attach / detach / set_egress / gc / leftovers: the network side of a sandbox's life."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import EgressPolicy, SandboxConfig
from ..errors import ConfigError, NetworkError, SandboxError
from ..secrets import SecretStore
from . import alloc, ca, dns, ip, nft, policy, procs, slirp4netns
from . import netns as _netns
from . import state as _state
from .settings import (
    NodeSettings,
    host_link,
    is_sandbox_id,
    metrics_file,
    node_dir,
    settings,
    tag,
    tag_of,
)
from .state import NetworkState

MODES = ("none", "host", "public", "sandbox")
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
PUBLIC_DNS_ADDR = "127.0.0.53"  # on the sandbox netns' loopback, which hostinet shares
_links_lock = threading.Lock()  # a link's nft element and its line in the state file go together


class NetworkAttachment(BaseModel):
    """How the runtime must start runsc for this sandbox's network."""

    model_config = ConfigDict(frozen=True)

    mode: str
    runsc_network: Literal["none", "host", "sandbox"]
    netns_path: str | None = None
    run_prefix: list[str] = Field(default_factory=list)
    resolv_conf: str | None = None
    hosts: str = HOSTS
    endpoints: dict[int, tuple[str, int]] = Field(default_factory=dict)


def attach(sandbox_id: str, config: SandboxConfig, state_dir: Path,
           settle: Callable[[str], None] | None = None) -> NetworkAttachment:
    """Create the sandbox's network. Bad input raises :class:`ConfigError` before anything
    exists; a failure half-way removes what was made and raises :class:`NetworkError`.
    ``settle(id)`` finishes a deleted sandbox's pending teardown (the runtime's): a port
    it still holds is published again at once, not "in use" until its teardown ran."""
    mode = config.network
    _validate(mode, config)
    tag_ = tag(sandbox_id)
    if mode == "none":
        return NetworkAttachment(mode=mode, runsc_network="none")
    if mode == "host":
        return NetworkAttachment(mode=mode, runsc_network="host", resolv_conf=_host_resolv())
    node = settings()
    egress = config.egress or EgressPolicy()
    st = NetworkState(
        sandbox_id=sandbox_id, mode=mode, tag=tag_, upstream=node.upstream_netns,
        internal=(node.veth_pool,), egress=egress, expose_addr=node.expose_addr,
        ports=config.expose_ports, inject=bool(egress.inject),
    )  # fmt: skip
    if (_netns.NETNS_DIR / tag_).exists() or _state.load(state_dir) is not None:
        raise NetworkError(f"network of {sandbox_id} already exists", sandbox_id=sandbox_id)
    if settle is not None and st.ports:
        with alloc.locked() as a:
            holders = {a.ports[k].sandbox_id for k in
                       (alloc.port_key(st.upstream, p) for p in st.ports) if k in a.ports}
        for holder in holders:  # outside the lock: a teardown takes it
            settle(holder)
    _reserve(st, node, state_dir)
    try:
        _state.save(state_dir, st)
        if mode == "public":
            return _attach_public(st, config, state_dir)
        return _attach_nat(st, config, state_dir)
    except BaseException as exc:
        try:
            _teardown(st, state_dir)
        except SandboxError:
            pass  # the original failure is the one to report
        if isinstance(exc, SandboxError):
            raise
        raise NetworkError(f"network setup failed: {exc}", sandbox_id=sandbox_id) from exc


def _validate(mode: str, config: SandboxConfig) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown network mode {mode!r}; use one of {', '.join(MODES)}")
    if config.dns is not None and mode not in ("public", "sandbox"):
        raise ConfigError(f"dns= needs a mode with a resolver (public, sandbox), not {mode!r}")
    if (config.egress is not None or config.expose_ports) and mode not in ("public", "sandbox"):
        raise ConfigError("egress= and expose_ports= need network='public' or 'sandbox'")
    if mode == "sandbox" and config.effective_rootless:
        raise ConfigError("network='sandbox' needs rootful mode (rootless=False, as root)")
    if mode in ("public", "sandbox") and os.geteuid() != 0:
        raise ConfigError(f"network={mode!r} needs root on this node")


def _host_resolv() -> str | None:
    try:
        return Path("/etc/resolv.conf").read_text()
    except OSError:
        return None


def _reserve(st: NetworkState, node: NodeSettings, state_dir: Path) -> None:
    """Lease ports (and a subnet for ``sandbox``) node-wide, owned by the sandboxes dir
    ``state_dir`` is in; the port check happens here, before anything is created."""
    state_dir = state_dir.resolve()
    owner = alloc.owner(state_dir.parent)
    with alloc.locked() as a:
        for port in st.ports:
            key = alloc.port_key(st.upstream, port)
            if key in a.ports or not _netns.port_free(st.upstream, st.expose_addr, port):
                raise ConfigError(f"port {st.expose_addr}:{port} is already in use",
                                  sandbox_id=st.sandbox_id)
        for port in st.ports:
            a.ports[alloc.port_key(st.upstream, port)] = alloc.Lease(
                sandbox_id=st.sandbox_id, owner=owner, upstream=st.upstream)
        if st.mode == "sandbox":
            routes = [dst for dst, _ in ip.routes(st.upstream)]
            st.subnet = alloc.free_subnet(a, node.veth_pool, routes)
            if a.subnet_users(st.upstream) == 0 and (st.upstream or "") not in a.forwarding:
                old = _netns.write_sysctl(st.upstream, "net.ipv4.ip_forward", "1")
                if old != "1":
                    a.forwarding[st.upstream or ""] = old
            a.subnets[st.subnet] = alloc.Lease(sandbox_id=st.sandbox_id, owner=owner,
                                               upstream=st.upstream)
        a.state_dirs[st.sandbox_id] = str(state_dir)  # resolved: its parent is the owner


def _step(st: NetworkState, state_dir: Path, **changes: object) -> None:
    for k, v in changes.items():
        setattr(st, k, v)
    _state.save(state_dir, st)


def _sets(st: NetworkState, egress: EgressPolicy) -> policy.Sets:
    return policy.sets_for(egress, ip.addresses(st.upstream), st.internal)


def _start_dns(
    st: NetworkState, config: SandboxConfig, state_dir: Path, listen: tuple[str, int],
    nft_netns: str | None, sets: policy.Sets,
) -> tuple[int, int | None]:
    """Bind the helper's sockets in the namespace the sandbox reaches them from, start it in
    the upstream; returns the port it listens on for DNS, and the egress proxy's port if the
    sandbox injects (the helper runs its proxy too: network/inject.py)."""
    _write_policy(state_dir, st.egress, sets)
    # sandbox mode publishes ports by DNAT: the helper holds them, so nothing else binds them
    held = _netns.hold_ports(st.upstream, st.expose_addr, st.ports) \
        if st.mode == "sandbox" else []
    where = st.netns if st.mode == "public" else st.upstream
    udp, tcp = _netns.bind_dns(where, *listen)
    with udp, tcp, contextlib.ExitStack() as holding:
        for s in held:
            holding.enter_context(s)
        cfg: dict[str, Any] = {
            "table": st.tag, "nft_netns": nft_netns,
            "upstreams": list(config.dns or dns.DEFAULT_UPSTREAMS),
            "policy_path": str(state_dir / _state.POLICY_FILE),
            "cache_path": str(state_dir / _state.CACHE_FILE),
            "udp_fd": udp.fileno(), "tcp_fd": tcp.fileno(),
            "held_fds": [s.fileno() for s in held],
        }  # fmt: skip
        fds = [udp.fileno(), tcp.fileno(), *cfg["held_fds"]]
        proxy_port = None
        if st.inject:
            # public: 127.0.0.53:443 in the sandbox's own netns; sandbox: any port of the
            # gateway, reached through the DNAT of gateway:443 (the node may serve 443)
            proxy = holding.enter_context(_netns.bind_proxy(
                where, listen[0], 443 if st.mode == "public" else 0))
            proxy_port = proxy.getsockname()[1]
            cfg["inject"] = _inject_config(st, state_dir, proxy.fileno(), listen[0])
            fds.append(proxy.fileno())
        proc = dns.start(tag=st.tag, config=cfg, state_dir=state_dir, upstream=st.upstream,
                         fds=fds)
        _step(st, state_dir, procs=[*st.procs, procs.track(proc, "dns")],
              proxy_port=proxy_port)
        port: int = udp.getsockname()[1]
        return port, proxy_port


def _inject_config(st: NetworkState, state_dir: Path, fd: int, steer_to: str
                   ) -> dict[str, Any]:
    """What the helper's egress proxy needs: its CA (made here, its key never leaves this
    directory), the secret store and audit file of the runtime owning the sandbox (its home:
    the parent of its sandboxes dir), the node's trust store for upstream TLS."""
    ca.make_ca(state_dir, st.sandbox_id)
    home = state_dir.resolve().parent.parent
    audit = home / "audit"
    audit.mkdir(mode=0o700, exist_ok=True)
    metrics = metrics_file(st.tag)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    return {
        "sandbox_id": st.sandbox_id, "state_dir": str(state_dir), "proxy_fd": fd,
        "steer_to": steer_to,
        "peer": _address(st) if st.mode == "sandbox" else None,
        "store_dir": str(SecretStore.of_home(home).root),
        "policy_path": str(state_dir / _state.POLICY_FILE),
        "audit_path": str(audit / "inject.jsonl"), "metrics_path": str(metrics),
        "upstream_ca": settings().inject_ca,
    }  # fmt: skip


def _write_policy(state_dir: Path, egress: EgressPolicy, sets: policy.Sets) -> None:
    """egress.json: what the DNS helper filters by, and what its egress proxy injects and
    which addresses it may connect to (the same tiers as the nft table)."""
    data = egress.model_dump(mode="json", include={"allow_domains", "default", "inject"})
    data["sets"] = {"cidrs": dict(sets.cidrs), "private_domains": sets.private_domains}
    tmp = state_dir / (_state.POLICY_FILE + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, state_dir / _state.POLICY_FILE)


def _attach_public(st: NetworkState, config: SandboxConfig, state_dir: Path) -> NetworkAttachment:
    ip.netns_add(st.tag)
    _step(st, state_dir, netns=st.tag)
    api = node_dir() / "sock" / f"{st.tag}.sock"
    api.parent.mkdir(parents=True, exist_ok=True)
    log = state_dir / "slirp4netns.log"
    starting = slirp4netns.start(netns=st.tag, upstream=st.upstream, api_socket=api, log=log)
    _step(st, state_dir, api_socket=str(api),
          procs=[*st.procs, procs.track(starting.proc, "slirp4netns")])
    ip.link_up(st.tag, "lo")
    # The sentry runs in its own user namespace (runtime/bundle.py identity_user_namespace),
    # which does not own this netns: without this, binding ports < 1024 fails (EACCES).
    # Per netns, so it reaches only this sandbox's namespace.
    _netns.write_sysctl(st.tag, "net.ipv4.ip_unprivileged_port_start", "0")
    sets = _sets(st, st.egress)
    nft.apply(st.tag, policy.public_table(st.tag, sets))
    _step(st, state_dir, table=True, table_netns=st.tag)
    _start_dns(st, config, state_dir, (PUBLIC_DNS_ADDR, 53), nft_netns=st.tag, sets=sets)
    slirp4netns.wait_ready(starting, log)
    for port in st.ports:
        slirp4netns.add_hostfwd(api, st.expose_addr, port, port)
    return NetworkAttachment(
        mode="public", runsc_network="host", netns_path=_netns.netns_path(st.tag),
        resolv_conf=dns.resolv_conf(PUBLIC_DNS_ADDR), endpoints=_endpoints(st),
    )  # fmt: skip


def _attach_nat(st: NetworkState, config: SandboxConfig, state_dir: Path) -> NetworkAttachment:
    net = ipaddress.IPv4Network(st.subnet)
    gateway, address = str(net[1]), str(net[2])
    link = host_link(st.tag)
    ip.netns_add(st.tag)
    _step(st, state_dir, netns=st.tag)
    ip.batch(st.upstream, ip.veth_commands(link, st.tag, "eth0", f"{gateway}/{net.prefixlen}"))
    _step(st, state_dir, link=link)
    ip.batch(st.tag, ip.sandbox_side_commands("eth0", f"{address}/{net.prefixlen}", gateway))
    if st.ports:
        # DNAT from the node's loopback to the veth needs 127/8 sources routable there
        _netns.write_sysctl(st.upstream, f"net.ipv4.conf.{link}.route_localnet", "1")
    sets = _sets(st, st.egress)
    dns_port, proxy_port = _start_dns(st, config, state_dir, (gateway, 0),
                                      nft_netns=st.upstream, sets=sets)
    params = policy.NatParams(
        link=link, gateway=gateway, address=address, subnet=str(net), dns_port=dns_port,
        expose_addr=st.expose_addr, ports=st.ports, proxy_port=proxy_port,
    )  # fmt: skip
    nft.apply(st.upstream, policy.nat_table(st.tag, sets, params))
    _step(st, state_dir, table=True, table_netns=st.upstream)
    return NetworkAttachment(
        mode="sandbox", runsc_network="sandbox", netns_path=_netns.netns_path(st.tag),
        run_prefix=_netns.mask_proc_sys_net(), resolv_conf=dns.resolv_conf(gateway),
        endpoints=_endpoints(st),
    )  # fmt: skip


def _endpoints(st: NetworkState) -> dict[int, tuple[str, int]]:
    return {p: (st.expose_addr, p) for p in st.ports}


def reattach(sandbox_id: str, state_dir: Path, *, readdress: bool = True) -> list[str]:
    """Ready a network that stayed attached while its sandbox was suspended (its netns,
    veth, nft table, leases and helpers were kept) for ``runsc restore`` of that sandbox;
    returns the prefix the restore runs under (:attr:`NetworkAttachment.run_prefix`).
    ``--network=sandbox`` takes the veth's address and routes out of the netns when it
    starts and builds its interfaces from what it finds there at a restore too, so they
    are put back (``replace``: a failed restore may have left them); ``readdress=False``
    when that was done already (at the suspend)."""
    st = _state.load(state_dir)
    if st is None or st.mode != "sandbox":
        if st is not None and st.mode == "public":
            raise ConfigError("a network='public' sandbox cannot be restored in place",
                              sandbox_id=sandbox_id)
        return []
    if not st.netns or not st.link or not st.subnet:
        raise NetworkError("the sandbox's network is not complete", sandbox_id=sandbox_id)
    if not readdress:
        return _netns.mask_proc_sys_net()
    net = ipaddress.IPv4Network(st.subnet)
    ip.batch(st.netns, ["link set lo up", f"addr replace {net[2]}/{net.prefixlen} dev eth0",
                        "link set eth0 up", f"route replace default via {net[1]}"])
    return _netns.mask_proc_sys_net()


def detach(sandbox_id: str, state_dir: Path) -> None:
    """Remove everything attach made for the sandbox (idempotent; works after a crash)."""
    st = _state.load(state_dir)
    if st is not None:
        _teardown(st, state_dir)
    elif sandbox_id in alloc.read().sandbox_ids():
        # No state but a lease: a crash between leasing and the first save, or a teardown
        # cut short after its state file went. Whatever exists goes by name before the lease
        # does: without the lease nothing would ever look for it again.
        _sweep({tag(sandbox_id)})
        _release({sandbox_id})
    _state.remove(state_dir)


def _teardown(st: NetworkState, state_dir: Path) -> None:
    """Undo attach step by step; every step runs even if an earlier one failed."""
    errors: list[str] = []

    def attempt(fn: Callable[[], None]) -> None:
        try:
            fn()
        except (SandboxError, OSError) as exc:
            errors.append(str(exc))

    for ref in st.procs:
        attempt(partial(procs.stop, ref))
    if st.table and st.table_netns != st.netns:  # a table inside our netns goes with it
        attempt(lambda: nft.delete_table(st.table_netns, "inet", st.tag))
    if st.link:
        attempt(partial(ip.link_delete, st.upstream, st.link))
    if st.netns:
        attempt(partial(ip.netns_delete, st.netns))
    if st.api_socket:
        attempt(partial(Path(st.api_socket).unlink, missing_ok=True))
    if st.inject:
        attempt(partial(metrics_file(st.tag).unlink, missing_ok=True))
    if not errors:  # while anything is left, the lease keeps it visible to gc
        attempt(lambda: _release({st.sandbox_id}))
    if errors:
        raise NetworkError("network teardown incomplete: " + "; ".join(errors),
                           sandbox_id=st.sandbox_id)
    _state.remove(state_dir)


def _release(sandbox_ids: set[str]) -> None:
    """Drop the leases of ``sandbox_ids``; give ``ip_forward`` back once no veth of any home
    needs it: no subnet lease in the node table and no veth of ours left in that namespace
    (e.g. one that a version keeping a table per home made)."""
    with alloc.locked() as a:
        for sid in sandbox_ids:
            a.release(sid)
        for key in list(a.forwarding):
            upstream = key or None
            if a.subnet_users(upstream):
                continue
            if upstream and not ip.netns_exists(upstream):
                del a.forwarding[key]  # the namespace is gone, and its setting with it
            elif not any(tag_of(link) for link in ip.links(upstream)):
                _netns.write_sysctl(upstream, "net.ipv4.ip_forward", a.forwarding.pop(key))


def set_egress(sandbox_id: str, state_dir: Path, egress: EgressPolicy | dict[str, Any]) -> None:
    """Replace the running sandbox's egress policy in one nft transaction; the DNS helper is
    told to reload. New and open connections see the new policy at once."""
    st = _state.load(state_dir)
    if st is None:
        raise NetworkError("sandbox has no network attached", sandbox_id=sandbox_id)
    if st.mode not in ("public", "sandbox"):
        raise ConfigError(f"egress policy needs network='public' or 'sandbox', not {st.mode!r}")
    try:
        egress = EgressPolicy.model_validate(egress)
    except ValidationError as exc:
        raise ConfigError(f"invalid egress policy: {exc}", sandbox_id=sandbox_id) from None
    if egress.inject and not st.inject:
        raise ConfigError("inject= needs a sandbox created with inject: only such a sandbox "
                          "trusts its egress proxy's CA", sandbox_id=sandbox_id)
    sets = _sets(st, egress)
    _write_policy(state_dir, egress, sets)  # the proxy reads it at its next request
    script = policy.update_script(st.tag, sets, _cached(state_dir, egress))
    nft.apply(st.table_netns, script)
    for ref in st.procs:
        if ref.what == "dns":
            procs.signal_if_alive(ref, signal.SIGHUP)
    _step(st, state_dir, egress=egress)


MAX_LINKS = 256  # per sandbox: the state file and the nft set stay small


def link(sandbox_id: str, state_dir: Path, peer_id: str, peer_dir: Path,
         port: int) -> tuple[str, int]:
    """Let sandbox ``sandbox_id`` open TCP connections to ``port`` of ``peer_id``, both
    ``network="sandbox"`` on this node; returns the address to connect to. Nothing else of
    the peer opens, and its replies are the only traffic back (docs/network.md, "Links")."""
    if not 0 < port < 65536:
        raise ConfigError(f"port must be 1-65535, not {port}", sandbox_id=sandbox_id)
    if sandbox_id == peer_id:
        raise ConfigError("a sandbox reaches its own ports on 127.0.0.1; no link is needed",
                          sandbox_id=sandbox_id)
    peer = _linkable(peer_id, peer_dir)
    with _links_lock:  # read under the lock: another link may be saving this state file
        st = _linkable(sandbox_id, state_dir)
        if (peer_id, port) not in st.peers:
            if len(st.peers) >= MAX_LINKS:
                st = _prune_links(st, state_dir)
            if len(st.peers) >= MAX_LINKS:
                raise ConfigError(f"at most {MAX_LINKS} links per sandbox", sandbox_id=sandbox_id)
            script = policy.link_script(st.tag, host_link(peer.tag), port, add=True)
            nft.apply(st.table_netns, script)
            _step(st, state_dir, peers=[*st.peers, (peer_id, port)])
    return _address(peer), port


def unlink(sandbox_id: str, state_dir: Path, peer_id: str, port: int) -> None:
    """Close a link made by :func:`link` (idempotent); its open connections are cut too. The
    peer may be gone already."""
    with _links_lock:
        st = _state.load(state_dir)
        if st is None or (peer_id, port) not in st.peers:
            return
        script = policy.link_script(st.tag, host_link(tag(peer_id)), port, add=False)
        nft.apply(st.table_netns, script)
        _step(st, state_dir, peers=[p for p in st.peers if p != (peer_id, port)])


def _prune_links(st: NetworkState, state_dir: Path) -> NetworkState:
    """Drop the links to peers whose veth is gone (deleted sandboxes), so a long-lived
    sandbox linking short-lived ones does not run into :data:`MAX_LINKS`."""
    live = set(ip.links(st.upstream))
    dead = [(p, port) for p, port in st.peers if host_link(tag(p)) not in live]
    if dead:
        nft.apply(st.table_netns, "".join(
            policy.link_script(st.tag, host_link(tag(p)), port, add=False) for p, port in dead))
        _step(st, state_dir, peers=[p for p in st.peers if p not in dead])
    return st


def links(state_dir: Path) -> list[tuple[str, int]]:
    """The (peer id, port) links of a sandbox, in the order they were made."""
    st = _state.load(state_dir)
    return [] if st is None else list(st.peers)


def address(state_dir: Path) -> str | None:
    """A ``sandbox``-mode sandbox's own address on its veth; None in other modes."""
    st = _state.load(state_dir)
    return _address(st) if st is not None and st.mode == "sandbox" and st.subnet else None


def _address(st: NetworkState) -> str:
    return str(ipaddress.IPv4Network(st.subnet or "")[2])


def _linkable(sandbox_id: str, state_dir: Path) -> NetworkState:
    st = _state.load(state_dir)
    if st is None or st.mode != "sandbox" or not st.link or not st.table:
        mode = st.mode if st else "no network"
        raise ConfigError(f"links join sandboxes with network='sandbox'; {sandbox_id} has "
                          f"{mode!r}", sandbox_id=sandbox_id)
    return st


def _cached(state_dir: Path, egress: EgressPolicy) -> dict[str, int]:
    """Addresses the helper resolved for names that stay allowed, with their time left."""
    try:
        cache = json.loads((state_dir / _state.CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    now = time.time()
    return {a: int(exp - now) for a, (name, exp) in cache.items()
            if exp - now >= 1 and policy.domain_allowed(name, egress.allow_domains)}


def gc(live_ids: set[str], sandboxes_dir: Path) -> list[str]:
    """Remove the network of every sandbox of ``sandboxes_dir`` (the calling runtime's) that
    the node table records and that is not in ``live_ids``: through its saved state, then by
    name for whatever that missed (its state dir may be gone, too). Every object is recorded
    before it is created, so nothing escapes; sandboxes of other sandboxes dirs (homes) are
    left alone, their names included. Returns what was removed."""
    recorded = alloc.read()
    dead = recorded.sandbox_ids(alloc.owner(sandboxes_dir)) - set(live_ids)
    removed: list[str] = []
    for sid in sorted(dead):
        if d := recorded.state_dirs.get(sid):
            try:
                detach(sid, Path(d))
                removed.append(f"sandbox {sid}")
            except SandboxError:
                pass  # the sweep below gets what is left
    keep = {tag(s) for s in (recorded.sandbox_ids() - dead) | set(live_ids) if is_sandbox_id(s)}
    removed += _sweep({tag(s) for s in dead} - keep)
    if dead:
        _release(dead)
    return removed


def _sweep(tags: set[str]) -> list[str]:
    """Remove, by name, every process, nft table, link and netns of ``tags``."""
    removed: list[str] = []
    for pid, t in procs.ours().items():
        if t in tags:
            procs.kill_tagged(pid)
            removed.append(f"process {pid} ({t})")
    for upstream in _upstreams():
        for family, name in nft.tables(upstream):
            if tag_of(name) in tags:
                nft.delete_table(upstream, family, name)
                removed.append(f"nft table {family} {name}")
        for link in ip.links(upstream):
            if tag_of(link) in tags:
                ip.link_delete(upstream, link)
                removed.append(f"link {link}")
    for name in ip.netns_list():
        if tag_of(name) in tags:
            ip.netns_delete(name)
            removed.append(f"netns {name}")
    for t in tags:
        with contextlib.suppress(FileNotFoundError):
            metrics_file(t).unlink()
            removed.append(f"metrics {t}")
    return removed


def _upstreams() -> list[str | None]:
    """The node's namespace plus the configured upstream, if it exists."""
    try:
        up = settings().upstream_netns
    except ConfigError:
        up = None
    return [None] + ([up] if up else [])


def leftovers() -> dict[str, list[str]]:
    """Every network object of this package on the node, by kind (empty lists = clean)."""
    out: dict[str, list[str]] = {
        "netns": [n for n in ip.netns_list() if tag_of(n)],
        "links": [],
        "nft_tables": [],
        "processes": [f"{pid} ({t})" for pid, t in sorted(procs.ours().items())],
        "mounts": [],
        "metrics": [],
        "leases": [],
    }
    for upstream in _upstreams():
        out["links"] += [f"{upstream or 'node'}:{n}" for n in ip.links(upstream) if tag_of(n)]
        out["nft_tables"] += [f"{upstream or 'node'}:{f} {n}" for f, n in nft.tables(upstream)
                              if tag_of(n)]
    with open("/proc/self/mountinfo") as f:
        out["mounts"] = [m for line in f if tag_of(Path(m := line.split()[4]).name)]
    metrics = metrics_file("x").parent
    out["metrics"] = sorted(p.name for p in metrics.glob("*.prom")) if metrics.is_dir() else []
    out["leases"] = sorted(alloc.read().sandbox_ids())
    return out
