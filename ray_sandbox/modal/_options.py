"""Modal's ``Sandbox.create`` arguments onto :func:`ray_sandbox.create`'s: the one place
where a Modal option becomes a SandboxConfig field (or a refusal naming it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime.config import EgressPolicy
from ..runtime.errors import ModalInvalidError

APP_LABEL = "modal.app"  # the App a sandbox was created for: Sandbox.list(app_id=) filters it
PORTS_LABEL = "modal.ports"  # its unencrypted ports, for tunnels() on any handle of it
ENCRYPTED_LABEL = "modal.encrypted_ports"  # ... and its encrypted ones (through the service)
PROBE_LABEL = "modal.probe"  # its readiness probe, for wait_until_ready() on any handle of it
MODAL_LABELS = (APP_LABEL, PORTS_LABEL, ENCRYPTED_LABEL, PROBE_LABEL)
DEFAULT_IMAGE = "ray-sandbox/python"  # Modal's default image is a Debian with Python

# Modal's create() arguments that need what this backend does not have (docs/compat.md):
# refused when given anything but their default.
UNSUPPORTED = {
    "gpu": "gpu (sandboxes have no GPU access here)",
    "cloud": "cloud (placement is Ray's)", "region": "region (placement is Ray's)",
    "network_file_systems": "network_file_systems",
    "pty": "pty on create", "pty_info": "pty_info",
    "h2_ports": "HTTP/2 tunnels (h2_ports)", "custom_domain": "custom_domain",
    "proxy": "proxy", "inbound_cidr_allowlist": "inbound_cidr_allowlist",
    "include_oidc_identity_token": "include_oidc_identity_token",
    "experimental_options": "experimental_options",
    "_experimental_persistent": "_experimental_persistent",
    "_experimental_outbound_policy": "_experimental_outbound_policy (header injection outside "
                                     "the sandbox)",
    "client": "client (there is no Modal client here)",
    "environment_name": "environment_name",
}


def refuse(options: Mapping[str, Any], what: str) -> None:
    """NotImplementedError naming the first option given a value this backend cannot
    honour (anything but its default: None, False or empty)."""
    for key, value in options.items():
        if value:
            raise NotImplementedError(f"{what}({key}=...): {UNSUPPORTED.get(key, key)} is "
                                      "not supported by ray_sandbox.modal (docs/compat.md)")


def _limit(what: str, value: Any, limit: Any) -> Any:
    """Modal's ``(request, limit)`` pairs, or a request and a ``<what>_limit``: a sandbox
    reserves in Ray what it may use, the limit when there is one."""
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise ModalInvalidError(f"{what}= takes a number or a (request, limit) pair")
        if limit is not None:
            raise ModalInvalidError(f"{what}=(request, limit) and {what}_limit= both set "
                                    "a limit")
        value, limit = value
    if limit is None:
        return value
    if value is not None and limit < value:
        raise ModalInvalidError(f"{what}_limit={limit} is below the request {what}={value}")
    return limit


def create_options(
    *, image: str | None, app: str | None, name: str | None, tags: Mapping[str, str] | None,
    env: Mapping[str, str | None] | None, secrets_env: Sequence[Mapping[str, str]],
    timeout: float | None, workdir: str | None, cpu: Any, memory: Any,
    block_network: bool, cidr_allowlist: Sequence[str] | None,
    outbound_domain_allowlist: Sequence[str] | None, unencrypted_ports: Sequence[int] = (),
    encrypted_ports: Sequence[int] = (),
    volumes: Mapping[str, Any] | None = None, idle_timeout: float | None = None,
    outbound_cidr_allowlist: Sequence[str] | None = None, cpu_limit: float | None = None,
    memory_limit: int | None = None, runtime: str | None = None, probe: str | None = None,
    snapshots: bool = False, others: Mapping[str, Any],
) -> dict[str, Any]:
    """:func:`ray_sandbox.create` keyword arguments for Modal's ``Sandbox.create``."""
    for key in others:
        if key not in UNSUPPORTED:  # as Python (and Modal) would: a typo must not pass
            raise TypeError(f"Sandbox.create() got an unexpected keyword argument {key!r}")
    refuse(others, "Sandbox.create")
    if runtime not in (None, "gvisor"):  # every sandbox here is gVisor's
        raise NotImplementedError(f"Sandbox.create(runtime={runtime!r}): sandboxes here run "
                                  "under gVisor only (runtime='gvisor') (docs/compat.md)")
    if cidr_allowlist is not None and outbound_cidr_allowlist is not None:
        raise ModalInvalidError("cidr_allowlist is the old name of outbound_cidr_allowlist: "
                                "give one of them")
    if outbound_cidr_allowlist is not None:
        cidr_allowlist = outbound_cidr_allowlist
    merged: dict[str, str] = {}
    for secret in secrets_env:
        merged.update(secret)
    merged.update({k: v for k, v in (env or {}).items() if v is not None})
    allow = (cidr_allowlist, outbound_domain_allowlist)
    if block_network and any(a is not None for a in allow):
        raise ModalInvalidError("block_network=True cannot be combined with an allowlist")
    out: dict[str, Any] = {
        "image": image or DEFAULT_IMAGE,
        "env": merged,
        "labels": {**(tags or {}), **({APP_LABEL: app} if app else {}),
                   **({PORTS_LABEL: ",".join(map(str, unencrypted_ports))}
                      if unencrypted_ports else {}),
                   **({ENCRYPTED_LABEL: ",".join(map(str, encrypted_ports))}
                      if encrypted_ports else {}),
                   **({PROBE_LABEL: probe} if probe else {})},
        # Modal's sandboxes reach the internet unless blocked: ours through network
        # "public" (private and metadata addresses stay denied, docs/network.md), or
        # "sandbox" (gVisor's own stack, the same egress policy) for one whose memory can be
        # snapshotted: runsc refuses to checkpoint "public" (hostinet) sandboxes
        "network": "none" if block_network else "sandbox" if snapshots else "public",
        "ttl_seconds": timeout,
    }
    if any(a is not None for a in allow):
        out["egress"] = EgressPolicy(allow_cidrs=tuple(cidr_allowlist or ()),
                                     allow_domains=tuple(outbound_domain_allowlist or ()),
                                     default="deny")
    if unencrypted_ports or encrypted_ports:  # on the sandbox's node (tunnels())
        out["expose_ports"] = tuple(dict.fromkeys([*unencrypted_ports, *encrypted_ports]))
    if idle_timeout is not None:
        out["idle_timeout_seconds"] = idle_timeout
    if volumes:  # path -> modal.Volume (or its name): our named volumes, placed on their node
        out["volumes"] = {path: getattr(v, "name", v) for path, v in volumes.items()}
    if name is not None:
        out["name"] = name
    if workdir is not None:
        out["workdir"] = workdir
    if (cpu := _limit("cpu", cpu, cpu_limit)) is not None:
        out["cpu"] = cpu
    if (memory := _limit("memory", memory, memory_limit)) is not None:
        out["memory"] = f"{memory}Mi"  # Modal counts MiB
    return out
