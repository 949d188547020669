"""Harbor network policies as ray_sandbox network modes and egress policies."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from harbor.models.task.config import NetworkMode, NetworkPolicy

from ..runtime.config import EgressPolicy
from ..runtime.config import NetworkMode as SandboxNetworkMode


def start_mode(policies: Sequence[NetworkPolicy], networked: SandboxNetworkMode) -> str:
    """The sandbox's network mode: ``none`` when no phase needs a network, else ``networked``,
    so that later phases can switch policy (egress rules need an attached network)."""
    if all(p.network_mode == NetworkMode.NO_NETWORK for p in policies):
        return "none"
    return networked


def egress(policy: NetworkPolicy) -> EgressPolicy:
    """The egress policy enforcing ``policy`` on a networked sandbox.

    ``public`` still refuses the node's private, link-local (cloud metadata) and own
    addresses, as every ray_sandbox egress policy does; ``no-network`` denies everything.
    """
    if policy.network_mode == NetworkMode.PUBLIC:
        return EgressPolicy()
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return EgressPolicy(default="deny")
    domains, cidrs = [], []
    for host in policy.allowed_hosts:
        try:
            cidrs.append(str(ipaddress.ip_network(host, strict=False)))
        except ValueError:
            domains.append(host)  # Harbor validated it: a hostname or *.suffix pattern
    return EgressPolicy(allow_domains=tuple(domains), allow_cidrs=tuple(cidrs), default="deny")
