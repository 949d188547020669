"""What a tenant may ask of a sandbox: a rule for every :class:`SandboxConfig` field.

A tenant is not an operator. The operator sets a :class:`TenantPolicy` per tenant and by
default (``ServiceConfig.policies``, ``--tenant-policy FILE``); :func:`admit` holds every
create of a tenant to it, on the config that will actually run (after the Ray layer's
defaults), and fills in what the policy decides (the disk cap, the operator's runtime
settings, the egress rules toward the cluster's nodes). A refused option is a 400 naming the
field and the rule.

``RULES`` names every field of ``SandboxConfig``: a field it does not name is refused for
tenants, so a new option stays the operator's until someone decides what tenants may do
with it (tests/unit/test_tenant_policy.py fails first). The HTTP API, the CLI with
``--url`` and every other ingress of the service go through :func:`admit`.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..runtime.config import (
    DEFAULT_DISK,
    DOCKER_DEFAULT_CAPABILITIES,
    DOCKER_IN_SANDBOX_CAPABILITIES,
    UNLIMITED,
    EgressPolicy,
    NetworkMode,
    Platform,
    PullNetwork,
    SandboxConfig,
    parse_size,
)
from ..runtime.errors import ConfigError, ImageReferenceError
from ..runtime.images import parse_reference
from ..runtime.images.reference import Transport
from ..runtime.network.policy import NEVER, PRIVATE
from . import _errors

RESERVED_LABELS = "ray-sandbox/"  # the Ray layer's and the service's own labels
FS_IMAGE_SCHEME = "fs-image://"  # a tenant's filesystem images (``_kept``)
AUTO_PIDS_MAX = 4096  # the most pids_limit="auto" gives on any node (runtime/config.py)
RESOLVE_TIMEOUT = 5.0
SECRET_SCOPE_PREFIX = "t-"  # a tenant's secrets on the nodes: t-<hash of the tenant>/<name>
T = TypeVar("T")


class TenantPolicy(BaseModel):
    """What one tenant may set. The defaults are safe for tenants who do not trust each
    other or the operator's network (docs/security.md, "Tenants")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    network_modes: tuple[NetworkMode, ...] = Field(
        ("none", "public", "sandbox"), description="'host' shares the node's network")
    capabilities: tuple[str, ...] = Field(
        DOCKER_DEFAULT_CAPABILITIES, description="the most a sandbox may hold (inside gVisor)")
    docker: bool = Field(False, description="docker=True (adds NET_ADMIN, SYS_ADMIN, "
                         "SYS_PTRACE inside gVisor)")
    disk_default: int = Field(DEFAULT_DISK, gt=0, description="cap when disk= is not given")
    disk_max: int = Field(16 * 2**30, gt=0, description="largest disk= a tenant may ask for")
    pids_max: int = Field(AUTO_PIDS_MAX, ge=256, description="largest pids_limit")
    max_cpu: float | None = Field(None, gt=0, description="cores of one sandbox")
    max_memory: int | None = Field(None, gt=0, description="bytes of one sandbox")
    max_ttl_seconds: float | None = Field(None, gt=0, description="longest life; also the "
                                          "default when the tenant gives none")
    max_ports: int = Field(16, ge=0, description="published ports of one sandbox")
    port_range: tuple[int, int] = Field(
        (1024, 65535), description="ports a sandbox may publish on its node (a published "
        "port is the node's: below 1024 it would stand in for the node's own services)")
    dns: tuple[str, ...] = Field((), description="resolvers a tenant may name in dns=")
    egress_cidrs: tuple[str, ...] = Field(
        (), description="non-public ranges a tenant may allow in egress.allow_cidrs")
    private_domains: bool = Field(False, description="whether allow_domains answers may "
                                  "open private addresses (internal services)")
    registries: tuple[str, ...] = Field(
        (), description="registries (host or host:port) a tenant may pull from although "
                        "they are loopback, private, link-local or a node of the cluster")
    host_images: bool = Field(False, description="images named by a path of the node "
                              "(oci:, oci-archive:, docker-archive:, dir:) or built on it "
                              "(localhost/NAME)")
    rootless: bool | Literal["auto"] = Field("auto", description="the operator's setting")
    platform: Platform = Field("ptrace", description="the operator's setting")
    directfs: bool = Field(True, description="the operator's setting (False hardens)")
    pull_network: PullNetwork = Field(
        "public", description="the operator's setting: 'public' pulls a tenant's image where "
        "only public addresses are reachable; a registry listed in registries is pulled "
        "from the node's network")

    @field_validator("disk_default", "disk_max", "max_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v) if isinstance(v, str) else v

    @field_validator("egress_cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_network(c, strict=False)) for c in v)

    @field_validator("dns")
    @classmethod
    def _dns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_address(a)) for a in v)

    @field_validator("capabilities", mode="before")
    @classmethod
    def _caps(cls, v: Any) -> Any:
        return SandboxConfig._caps(v)


def parse_policies(text: str, where: str) -> dict[str, TenantPolicy]:
    """A policy file: JSON ``{"default": {...}, "tenants": {"alice": {...}}}``; a tenant's
    entry is applied over the default's."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) - {"default", "tenants"}:
            raise ValueError('expected {"default": {...}, "tenants": {name: {...}}}')
        base = raw.get("default") or {}
        out = {"*": TenantPolicy.model_validate(base)}
        for tenant, over in (raw.get("tenants") or {}).items():
            out[tenant] = TenantPolicy.model_validate({**base, **over})
        return out
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"bad tenant policy {where}: {exc}") from None


def load_policies(path: Path) -> dict[str, TenantPolicy]:
    try:
        return parse_policies(path.read_text(), str(path))
    except OSError as exc:
        raise ConfigError(f"cannot read the tenant policy {path}: {exc.strerror}") from None


# --- the node side: what no tenant's sandbox may reach --------------------------------------


@dataclass
class Nodes:
    """The cluster's node addresses (asked of Ray at most every ``ttl`` seconds) and name
    resolution with a bound: what the image and egress rules need."""

    addresses: Callable[[], Iterable[str]]
    ttl: float = 30.0
    _cached: tuple[str, ...] = ()
    _at: float = field(default=-1e9)

    def known(self) -> tuple[str, ...]:
        if time.monotonic() - self._at > self.ttl:
            self._cached = tuple(sorted(set(self.addresses())))
            self._at = time.monotonic()
        return self._cached


def ray_node_addresses() -> list[str]:
    """Every address of every node Ray knows (alive or not: a node that comes back keeps
    its address), and this node's own."""
    import ray

    out = [n.get("NodeManagerAddress", "") for n in ray.nodes()]
    try:
        out += [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:
        pass
    return [a for a in out if a]


# Besides the runtime's never and private tiers: ranges that lead elsewhere than they seem
# (IPv4 inside IPv6: mapped, NAT64, 6to4, Teredo) or that are reserved for networks of their
# own (benchmarking 198.18/15, IETF protocol assignments, documentation).
TENANT_NEVER = ("::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "2001::/32",
                "198.18.0.0/15", "192.0.0.0/24", "192.0.2.0/24", "198.51.100.0/24",
                "203.0.113.0/24")


def _special(addr: str, nodes: Iterable[str]) -> bool:
    """Loopback, link-local, private, multicast, reserved, unspecified, or a node's."""
    ip = ipaddress.ip_address(addr)
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped  # type: ignore[union-attr]
    nets = [ipaddress.ip_network(c) for c in (*NEVER, *PRIVATE, *TENANT_NEVER)]
    return any(ip in n for n in nets if n.version == ip.version) or str(ip) in set(nodes)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _overlaps_special(cidr: str, nodes: Iterable[str]) -> bool:
    net = ipaddress.ip_network(cidr, strict=False)
    for c in (*NEVER, *PRIVATE, *TENANT_NEVER, *nodes):
        other = ipaddress.ip_network(c, strict=False)
        if other.version == net.version and net.overlaps(other):
            return True
    return False


_LOOKUPS = threading.BoundedSemaphore(64)  # name lookups at once, over every tenant


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> list[str]:
    """``host``'s addresses (an address is itself); [] if it does not resolve. A lookup
    that takes longer than ``timeout`` (counted from its own start, never from a queue)
    raises TimeoutError; its thread finishes on its own, holding one of 64 places, and a
    lookup that finds none free is a TimeoutError at once. A tenant has at most its
    pending creates' worth of lookups in flight (``max_pending_creates``)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    if not _LOOKUPS.acquire(blocking=False):
        raise TimeoutError("every name lookup place is taken")
    found: list[str] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.extend(sorted({str(a[4][0]) for a in socket.getaddrinfo(host, None)}))
        except OSError:
            pass
        finally:
            done.set()
            _LOOKUPS.release()

    threading.Thread(target=lookup, name="rsb-resolve", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{host} did not resolve within {timeout:g} s")
    return found


# --- the rules ------------------------------------------------------------------------------


def Refused(name: str, rule: str) -> ConfigError:  # noqa: N802 - reads as a raise
    """A tenant's option the policy refuses: the field and the rule, as a 400."""
    return ConfigError(f"{name}: {rule} (tenant policy)")


@dataclass(frozen=True)
class Ask:
    """One tenant's create: its policy, what it set, the config that will run."""

    policy: TenantPolicy
    given: Mapping[str, Any]
    config: SandboxConfig
    nodes: tuple[str, ...]
    resolve: Callable[[str], list[str]]


Rule = Callable[[Ask], None]  # raises Refused if the config breaks the rule


def _free(_: Ask) -> None:
    """any value the runtime accepts"""


def _image(a: Ask) -> None:
    """registry images, ray-sandbox/ images and the tenant's own fs-image:// ones; a path
    of the node or a node's own build (localhost/NAME) only with host_images; a registry on
    a loopback, link-local, private or node address only if listed in registries"""
    image = a.given.get("image")
    if not isinstance(image, str) or image.startswith(FS_IMAGE_SCHEME):
        return  # the default image, or the tenant's own filesystem image (checked by _kept)
    try:
        ref = parse_reference(image)
    except ImageReferenceError:
        return  # the create reports it, as for any bad reference
    if ref.reads_host_files and not a.policy.host_images:
        raise Refused("image", f"{image!r} names files of the host (a path, or a build of "
                               "the node); use a registry image or a ray-sandbox/ image")
    if ref.transport is Transport.DOCKER and ref.registry not in a.policy.registries:
        host = ref.host or ""
        try:
            addrs = [str(ipaddress.ip_address(host))] if _is_address(host) else a.resolve(host)
        except TimeoutError:
            raise Refused("image", f"registry {ref.registry!r} did not resolve within "
                                   f"{RESOLVE_TIMEOUT:g} s, or too many lookups are under "
                                   "way; retry") from None
        # the same answer whatever listens there: never a port scanner of the node's side
        if host == "localhost" or any(_special(x, a.nodes) for x in addrs):
            raise Refused("image", f"registry {ref.registry!r} is on a loopback, private, "
                                   "link-local or cluster address, which tenants may not "
                                   "pull from (the operator may list it in the tenant "
                                   "policy's registries)")


def _limit(name: str, bound: str) -> Rule:
    def rule(a: Ask) -> None:
        value, most = getattr(a.config, name), getattr(a.policy, bound)
        if value is None:
            raise Refused(name, "a limit is required")
        if most is not None and value > most:
            raise Refused(name, f"at most {most} ({bound} of the tenant policy)")

    rule.__doc__ = f"required; at most the policy's {bound}"
    return rule


def _disk(a: Ask) -> None:
    """always capped: disk_default when not given, at most disk_max; 'unlimited' refused"""
    disk = a.config.disk
    if disk == UNLIMITED or disk is None:
        raise Refused("disk", "'unlimited' is refused: tenants' disks are always capped")
    if isinstance(disk, int) and disk > a.policy.disk_max:
        raise Refused("disk", f"at most {a.policy.disk_max} bytes (disk_max)")


def _pids(a: Ask) -> None:
    """'auto' or 256..pids_max; null (unbounded) refused"""
    value = a.config.pids_limit
    if value is None:
        raise Refused("pids_limit", "null (unbounded) is refused: at most "
                                    f"{a.policy.pids_max} (pids_max)")
    if value != "auto" and value > a.policy.pids_max:
        raise Refused("pids_limit", f"at most {a.policy.pids_max} (pids_max)")
    if value == "auto" and a.policy.pids_max < AUTO_PIDS_MAX:
        raise Refused("pids_limit", f"'auto' may give {AUTO_PIDS_MAX}: at most "
                                    f"{a.policy.pids_max} (pids_max)")


def _caps(a: Ask) -> None:
    """within the policy's capabilities (Docker's default set), plus Docker's three only
    with docker=True where the policy allows it"""
    allowed = set(a.policy.capabilities)
    if a.config.docker:
        allowed |= set(DOCKER_IN_SANDBOX_CAPABILITIES)
    extra = sorted(set(a.config.effective_capabilities) - allowed)
    if extra:
        raise Refused("capabilities", f"{', '.join(extra)} not allowed (the tenant policy's "
                                      "capabilities)")


def _docker(a: Ask) -> None:
    """only where the policy allows docker"""
    if a.config.docker and not a.policy.docker:
        raise Refused("docker", "docker=True is not allowed by the tenant policy")


def _network(a: Ask) -> None:
    """one of network_modes ('host' only where listed)"""
    if a.config.network not in a.policy.network_modes:
        raise Refused("network", f"{a.config.network!r} is not allowed (allowed: "
                                 f"{', '.join(a.policy.network_modes)})")


def _dns(a: Ask) -> None:
    """only resolvers the policy lists in dns"""
    bad = [d for d in a.config.dns or () if str(ipaddress.ip_address(d)) not in a.policy.dns]
    if bad:
        raise Refused("dns", f"{', '.join(bad)} not allowed (the tenant policy's dns)")


def _egress(a: Ask) -> None:
    """allow_cidrs must be public (or within egress_cidrs); domain answers open no private
    address (unless private_domains); every node of the cluster is denied; inject names only
    the tenant's own secrets (the service puts them in its scope)"""
    eg = a.config.egress
    if eg is None:
        return
    for rule in eg.inject:
        if rule.secret is not None and not re.match(rf"^{SECRET_SCOPE_PREFIX}[0-9a-f]{{16}}/",
                                                    rule.secret):
            raise Refused("egress", f"inject: secret {rule.secret!r} is not one of the "
                                    "tenant's (PUT /secrets/{name} stores one)")
    for cidr in eg.allow_cidrs:
        net = ipaddress.ip_network(cidr)
        inside = any(net.version == o.version and net.subnet_of(o)  # type: ignore[arg-type]
                     for o in map(ipaddress.ip_network, a.policy.egress_cidrs))
        if not inside and _overlaps_special(cidr, a.nodes):
            raise Refused("egress", f"allow_cidrs {cidr} reaches loopback, private, "
                                    "link-local or cluster addresses (the operator may list "
                                    "ranges in the tenant policy's egress_cidrs)")


def _ports(a: Ask) -> None:
    """at most max_ports, each within port_range (1024-65535)"""
    if len(a.config.expose_ports) > a.policy.max_ports:
        raise Refused("expose_ports", f"at most {a.policy.max_ports} ports (max_ports)")
    lo, hi = a.policy.port_range
    outside = [p for p in a.config.expose_ports if not lo <= p <= hi]
    if outside:
        raise Refused("expose_ports", f"{', '.join(map(str, outside))} outside {lo}-{hi} "
                                      "(port_range)")


def _ttl(a: Ask) -> None:
    """at most max_ttl_seconds, its default when given"""
    most, ttl = a.policy.max_ttl_seconds, a.config.ttl_seconds
    if most is not None and (ttl is None or ttl > most):
        raise Refused("ttl_seconds", f"at most {most:g} seconds (max_ttl_seconds)")


def _labels(a: Ask) -> None:
    """keys outside ray-sandbox/ (the service's own)"""
    if any(k.startswith(RESERVED_LABELS) for k in a.config.labels):
        raise Refused("labels", f"keys starting with {RESERVED_LABELS!r} are reserved")


def _operator(name: str) -> Rule:
    def rule(a: Ask) -> None:
        if getattr(a.config, name) != getattr(a.policy, name):
            raise Refused(name, f"the operator's to set (here {getattr(a.policy, name)!r})")

    rule.__doc__ = "the operator's: the policy's value, whatever the tenant sends"
    return rule


def _listed(policy: TenantPolicy, image: Any) -> bool:
    """Whether ``image`` is on a registry the operator listed (and trusts)."""
    try:
        ref = parse_reference(image) if isinstance(image, str) else None
    except ImageReferenceError:
        return False
    return ref is not None and ref.transport is Transport.DOCKER and \
        ref.registry in policy.registries


def _pulls(a: Ask) -> None:
    """the operator's: the policy's value, 'public' by default (the pull reaches only public
    addresses: no realm, redirect or name leads it to the node's side); 'node' for a registry
    listed in registries"""
    wanted = "node" if _listed(a.policy, a.given.get("image")) else a.policy.pull_network
    if a.config.pull_network != wanted:
        raise Refused("pull_network", f"the operator's to set (here {wanted!r})")


def _volumes(_: Ask) -> None:
    """the tenant's own volumes, by the names it gave them (mapped by the service)"""


def _workdir(_: Ask) -> None:
    """any path the runtime accepts; with a read-only root it is on the capped disk"""


def _suspend(_: Ask) -> None:
    """any value the runtime accepts: the node keeps the suspended state on its disk, within
    its budget for suspended sandboxes (past it the sandbox stays running, never deleted)"""


def _never(a: Ask) -> None:
    """code; it cannot cross to a tenant"""
    if a.config.spec_transform is not None:
        raise Refused("spec_transform", "code cannot cross to a tenant")


RULES: dict[str, Rule] = {
    "image": _image, "cpu": _limit("cpu", "max_cpu"), "memory": _limit("memory", "max_memory"),
    "disk": _disk, "pids_limit": _pids, "env": _free, "workdir": _workdir, "volumes": _volumes,
    "shell": _free, "readonly": _free, "capabilities": _caps, "user": _free, "ttl_seconds": _ttl,
    "idle_timeout_seconds": _free, "idle_suspend_seconds": _suspend, "timeout_seconds": _free,
    "network": _network, "dns": _dns,
    "egress": _egress, "expose_ports": _ports, "rootless": _operator("rootless"),
    "platform": _operator("platform"), "directfs": _operator("directfs"), "docker": _docker,
    "labels": _labels, "spec_transform": _never, "pull_network": _pulls,
}  # fmt: skip
OPERATOR_FIELDS = ("rootless", "platform", "directfs", "pull_network")


def describe() -> dict[str, str]:
    """Each field's rule in words (docs/security.md's table is checked against it)."""
    return {name: " ".join((rule.__doc__ or "").split()) for name, rule in RULES.items()}


def fill(policy: TenantPolicy, given: Mapping[str, Any],
         nodes: tuple[str, ...]) -> dict[str, Any]:
    """What the policy decides where the tenant left it to it: the operator's settings, the
    disk cap, pids and TTL bounds, every node of the cluster denied in a networked sandbox's
    egress (from what the tenant gave alone, so the config is made and checked once)."""
    out: dict[str, Any] = {}
    for name in OPERATOR_FIELDS:
        wanted = getattr(policy, name)
        if name in given and given[name] != wanted:
            raise Refused(name, f"the operator's to set (here {wanted!r})")
        out[name] = wanted
    if _listed(policy, given.get("image")):
        out["pull_network"] = "node"  # the operator's registry, where it redirects included
    if given.get("disk") is None:  # the policy's default, not the Ray layer's
        out["disk"] = policy.disk_default
    if given.get("pids_limit", "auto") == "auto" and policy.pids_max < AUTO_PIDS_MAX:
        out["pids_limit"] = policy.pids_max
    if policy.max_ttl_seconds is not None and given.get("ttl_seconds") is None:
        out["ttl_seconds"] = policy.max_ttl_seconds
    if given.get("network") in ("public", "sandbox"):
        try:
            eg = EgressPolicy.model_validate(given.get("egress") or {})
        except ValidationError as exc:
            raise ConfigError(f"invalid sandbox config: egress: {exc.errors()[0]['msg']}") \
                from None
        denied = [f"{n}/{32 if ipaddress.ip_address(n).version == 4 else 128}" for n in nodes]
        out["egress"] = eg.model_copy(update={
            "deny_cidrs": tuple(dict.fromkeys((*eg.deny_cidrs, *denied))),
            "private_domains": eg.private_domains and policy.private_domains,
        })
    return out


def admit(policy: TenantPolicy, given: Mapping[str, Any], make: Callable[[dict[str, Any]], T],
          nodes: tuple[str, ...], resolver: Callable[[str], list[str]] = resolve) -> T:
    """What a tenant's create runs: ``given`` (what it set) completed by ``policy`` and made
    by ``make`` (the Ray layer's template, or a bare config: one validation), then held to
    every rule. Raises a 400 naming the field and the rule (or the config's own error)."""
    unknown = sorted(set(given) - set(RULES))
    if unknown:
        raise _errors.refusal(400, f"{', '.join(unknown)}: no tenant policy covers this "
                                   "option, so tenants may not set it")
    try:
        made = make({**given, **fill(policy, given, nodes)})
        ask = Ask(policy, given, getattr(made, "config", made), nodes, resolver)
        for rule in RULES.values():
            rule(ask)
    except ConfigError as exc:
        raise _errors.refusal(400, exc.message) from None
    return made
