"""Egress policy -> nftables scripts. Pure functions: no I/O, unit-tested on their text.

Every sandbox gets one table ``inet rsb-<tag>``. Its ``egress`` chain decides every packet the
sandbox sends in the *original* direction of a connection (replies to connections made *into*
the sandbox, e.g. an exposed port, pass), in this order:

    deny_cidrs, other sandboxes' veth pool   -> refuse   (deny wins over everything)
    allow_cidrs                              -> accept
    never tier: loopback, link-local (cloud metadata), multicast, reserved, node addresses
                                             -> refuse
    dyn set: answers for allow_domains       -> accept   (filled by the DNS helper)
    private tier: RFC 1918, CGNAT, ULA       -> refuse   (before the dyn set with
                                                          private_domains=False)
    anything else                            -> policy.default

In ``sandbox`` mode a link (:func:`link_script`) is checked before all of that: the set
``peers`` holds (host end of another sandbox's veth, TCP port) pairs this sandbox may open
connections to. It names the peer's veth, not its address, so a link can never open a later
sandbox that happens to get the same address: veth names come from sandbox ids.

Domain answers can open a private address (an internal service) but never the never tier, so a
name that resolves to 169.254.169.254 (DNS rebinding) stays blocked. Since every original-
direction packet is checked, a policy change also cuts connections that are already open.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the DNS helper imports this module and must stay free of pydantic
    from ..config import EgressPolicy

PRIVATE: tuple[str, ...] = (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7",
)  # fmt: skip
NEVER: tuple[str, ...] = (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "fe80::/10", "ff00::/8",
)  # fmt: skip
STATIC_SETS = ("deny", "allow", "never", "private")
DYN_SETS = ("dyn4", "dyn6")
DNS_TTL_MIN, DNS_TTL_MAX = 60, 3600


@dataclass(frozen=True)
class Sets:
    """Collapsed CIDRs per set name (``deny4``, ``deny6``, ``allow4``, … ``private6``)."""

    cidrs: Mapping[str, tuple[str, ...]]
    default: str
    private_domains: bool = True  # domain answers may open the private tier


@dataclass(frozen=True)
class NatParams:
    """What the ``sandbox`` (veth + NAT) mode table needs besides the policy."""

    link: str  # host end of the veth
    gateway: str  # its address; the sandbox's DNS server address
    address: str  # the sandbox's address
    subnet: str
    dns_port: int  # where the DNS helper listens on the gateway
    expose_addr: str
    ports: tuple[int, ...]
    proxy_port: int | None = None  # the egress proxy on the gateway, reached as gateway:443


def split(cidrs: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Collapse CIDRs into non-overlapping IPv4 and IPv6 networks (nft intervals must not
    overlap)."""
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    v4 = ipaddress.collapse_addresses(n for n in nets if n.version == 4)
    v6 = ipaddress.collapse_addresses(n for n in nets if n.version == 6)
    return tuple(map(str, v4)), tuple(map(str, v6))


def sets_for(policy: EgressPolicy, node_addrs: Sequence[str], internal: Sequence[str]) -> Sets:
    """The CIDR sets for ``policy`` on a node owning ``node_addrs``; ``internal`` are ranges no
    sandbox may reach whatever it allows (other sandboxes)."""
    groups = {
        "deny": (*policy.deny_cidrs, *internal),
        "allow": policy.allow_cidrs,
        "never": (*NEVER, *node_addrs),
        "private": PRIVATE,
    }
    cidrs: dict[str, tuple[str, ...]] = {}
    for name, members in groups.items():
        cidrs[name + "4"], cidrs[name + "6"] = split(members)
    return Sets(cidrs=cidrs, default=policy.default, private_domains=policy.private_domains)


def _set_decls(sets: Sets) -> list[str]:
    out = []
    for name in STATIC_SETS:
        for ver, typ in (("4", "ipv4_addr"), ("6", "ipv6_addr")):
            out.append(f"\tset {name}{ver} {{ type {typ}; flags interval; }}")
    out.append("\tset dyn4 { type ipv4_addr; flags timeout; }")
    out.append("\tset dyn6 { type ipv6_addr; flags timeout; }")
    return out


def _egress_rules(sets: Sets) -> list[str]:
    tiers = [("deny", "goto refuse"), ("allow", "accept"), ("never", "goto refuse"),
             ("dyn", "accept"), ("private", "goto refuse")]
    if not sets.private_domains:  # the private tier before domain answers: names open none
        tiers[3], tiers[4] = tiers[4], tiers[3]
    rules = []
    for name, verdict in tiers:
        rules += [f"ip daddr @{name}4 {verdict}", f"ip6 daddr @{name}6 {verdict}"]
    rules.append("accept" if sets.default == "allow" else "goto refuse")
    return rules


def _elements(table: str, sets: Sets, dyn: Mapping[str, int]) -> list[str]:
    lines = [
        f"add element inet {table} {name} {{ {', '.join(members)} }}"
        for name, members in sets.cidrs.items()
        if members
    ]
    lines += dyn_elements(table, dyn)
    return lines


def dyn_elements(table: str, dyn: Mapping[str, float]) -> list[str]:
    """Lines adding resolved addresses (address -> seconds to keep) to the dyn sets."""
    lines = []
    for ver in (4, 6):
        members = [
            f"{a} timeout {max(1, int(t))}s"
            for a, t in sorted(dyn.items())
            if ipaddress.ip_address(a).version == ver
        ]
        if members:
            lines.append(f"add element inet {table} dyn{ver} {{ {', '.join(members)} }}")
    return lines


def _chain(name: str, hook: str | None, rules: Sequence[str], kind: str = "filter") -> list[str]:
    head = [f"\tchain {name} {{"]
    if hook:
        prio = {"filter": 0, "dstnat": -100, "srcnat": 100}[kind]  # numbers: 1.0.6 rejects
        # the names dstnat/srcnat on the output hook
        typ = "filter" if kind == "filter" else "nat"
        head.append(f"\t\ttype {typ} hook {hook} priority {prio}; policy accept;")
    return head + [f"\t\t{r}" for r in rules] + ["\t}"]


_REFUSE = ["meta l4proto tcp reject with tcp reset", "reject with icmpx type admin-prohibited"]


def _table(table: str, sets: Sets, chains: list[str], extra_sets: Sequence[str] = ()) -> str:
    body = [
        f"table inet {table} {{",
        *_set_decls(sets),
        *extra_sets,
        *_chain("refuse", None, _REFUSE),
        *_chain("egress", None, _egress_rules(sets)),
        *chains,
        "}",
    ]
    return "\n".join(body + _elements(table, sets, {})) + "\n"


def public_table(table: str, sets: Sets) -> str:
    """Table for the sandbox's own netns (``public`` mode): the sentry's host sockets send from
    this namespace, so the output hook sees every packet before it reaches slirp4netns' tap."""
    output = ["oifname \"lo\" accept", "ct direction reply accept", "jump egress"]
    return _table(table, sets, _chain("output", "output", output))


def nat_table(table: str, sets: Sets, p: NatParams) -> str:
    """Table for the upstream netns (``sandbox`` mode): filter what the veth forwards, NAT it
    out, point the sandbox's DNS at the helper and publish exposed ports."""
    iif = f'iifname "{p.link}"'
    dns = f"meta l4proto {{ tcp, udp }} th dport {p.dns_port}"
    local = "fib daddr type local" if p.expose_addr == "0.0.0.0" else f"ip daddr {p.expose_addr}"
    dnat = [f"{local} tcp dport {port} dnat ip to {p.address}:{port}" for port in p.ports]
    proxy_in, proxy_dnat = [], []
    if p.proxy_port is not None:  # the egress proxy: names it injects into resolve to gateway
        proxy_in = [f"{iif} ip daddr {p.gateway} tcp dport {p.proxy_port} accept"]
        proxy_dnat = [f"{iif} ip daddr {p.gateway} tcp dport 443 "
                      f"dnat ip to {p.gateway}:{p.proxy_port}"]
    chains = [
        *_chain("forward", "forward", [f"{iif} oifname . tcp dport @peers accept",
                                       f"{iif} ct direction original jump egress"]),
        *_chain("input", "input", [f"{iif} ip daddr {p.gateway} {dns} accept", *proxy_in,
                                   f"{iif} ct direction original jump egress"]),
        *_chain("prerouting", "prerouting", [
            f"{iif} ip daddr {p.gateway} meta l4proto {{ tcp, udp }} th dport 53 "
            f"dnat ip to {p.gateway}:{p.dns_port}",
            *proxy_dnat,
            *dnat,
        ], "dstnat"),
        *_chain("output_nat", "output", dnat, "dstnat"),
        *_chain("postrouting", "postrouting", [
            f'ip saddr {p.subnet} oifname != "{p.link}" masquerade',
            # exposed ports reached from the node's loopback need a routable source
            f'oifname "{p.link}" ip saddr 127.0.0.0/8 masquerade',
        ], "srcnat"),
    ]
    return _table(table, sets, chains, [PEERS_DECL])


PEERS_DECL = "\tset peers { type ifname . inet_service; }"


def link_script(table: str, peer_link: str, port: int, *, add: bool) -> str:
    """Add (or delete) the link to TCP ``port`` behind ``peer_link`` in a ``sandbox``-mode
    table. The element is checked on every forwarded packet, so a deletion also cuts open
    connections."""
    if not 0 < port < 65536 or not peer_link.isalnum():
        raise ValueError(f"bad link {peer_link!r}:{port}")
    verb = "add" if add else "delete"
    return f'{verb} element inet {table} peers {{ "{peer_link}" . {port} }}\n'


def update_script(table: str, sets: Sets, dyn: Mapping[str, int]) -> str:
    """One transaction replacing the sets and the egress chain of an existing table."""
    names = [n + v for n in STATIC_SETS for v in "46"] + list(DYN_SETS)
    lines = [f"flush chain inet {table} egress"]
    lines += [f"flush set inet {table} {n}" for n in names]
    lines += [f"add rule inet {table} egress {r}" for r in _egress_rules(sets)]
    lines += _elements(table, sets, dyn)
    return "\n".join(lines) + "\n"


def domain_allowed(name: str, patterns: Iterable[str]) -> bool:
    """``example.com`` matches itself only; ``*.example.com`` matches its subdomains only."""
    name = name.lower().rstrip(".")
    for p in patterns:
        if p.startswith("*."):
            if name.endswith(p[1:]) and len(name) > len(p) - 1:
                return True
        elif name == p:
            return True
    return False


def dns_timeout(ttl: int) -> int:
    """How long a resolved address stays allowed: the record's TTL, kept within bounds so an
    address outlives short TTLs for a while and does not stay open forever."""
    return min(max(ttl, DNS_TTL_MIN), DNS_TTL_MAX)
