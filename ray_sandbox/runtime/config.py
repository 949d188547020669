"""SandboxConfig: the one description of a sandbox, shared by the runtime, the Ray layer,
pools and integrations. Everything is validated here, before any work is done.

(Over 600 lines on purpose: one pydantic model whose fields carry their own descriptions, which
the CLI, the service's schema and the tenant policy read; the egress, volume and port
sub-models used by those fields sit beside it.)"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from . import secrets
from .errors import ConfigError

DEFAULT_IMAGE = "ray-sandbox/python:latest"
# What a sandbox may write to the node's disk when ``disk=`` is not given (a writable root or
# a read-only root's workdir; sparse: it costs what is written). ``disk="unlimited"`` asks for
# no cap, explicitly.
DEFAULT_DISK = 4 * 2**30
UNLIMITED = "unlimited"

# Docker's default capability set (moby oci/caps/defaults.go); the default for sandboxes.
DOCKER_DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)

# What Docker inside a sandbox needs (``docker=True``): Docker's default set plus the three
# gVisor's "Docker in gVisor" tutorial lists for a nested Docker: NET_ADMIN (bridges, veths,
# routes), SYS_ADMIN (overlay and namespace mounts, cgroups) and SYS_PTRACE (runc). They hold
# inside gVisor's own kernel; docs/security.md ("Docker inside a sandbox") says what that opens.
DOCKER_IN_SANDBOX_CAPABILITIES: tuple[str, ...] = (
    *DOCKER_DEFAULT_CAPABILITIES, "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE",
)
# dockerd + containerd idle at ~60 MiB inside gVisor; below this a `docker run` OOM-kills the
# whole sandbox (docs/docker.md, "Costs").
DOCKER_MIN_MEMORY = 256 * 2**20

_KNOWN_CAPS = frozenset(
    "CAP_" + n
    for n in (
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
        "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
        "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
        "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
        "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
        "CHECKPOINT_RESTORE"
    ).split()
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?|[kmgt]i?|B|b)?\s*$")
_UNITS = {
    None: 1, "B": 1, "b": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}  # fmt: skip

_MAX_SIZE = 2**60
# Past threading.TIMEOUT_MAX (~292 years) a wait raises OverflowError; long before that a
# number is a mistake. A sandbox may live a year; one exec call may take a week.
MAX_TTL = 365 * 86400.0
MAX_TIMEOUT = 7 * 86400.0
AGENT_DIR = "/.rsb"  # the in-sandbox agent's own directory (docs/agent.md)
# pids_limit="auto": the node's pid_max is shared by this many sandboxes at their limit, with
# half of it left to everything else on the node; never below what ~110 guest processes need
# on ptrace (a rollout forking 64 Python workers needs ~600), never above 4096.
PLANNED_DENSITY = 32
_AUTO_PIDS = (1024, 4096)
_MIN_DISK = 2**20
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DOMAIN_RE = re.compile(rf"^(\*\.)?({_LABEL}\.)*{_LABEL}$")

NetworkMode = Literal["none", "public", "host", "sandbox"]
Platform = Literal["ptrace", "systrap"]
PullNetwork = Literal["node", "public"]


def check_text(value: str, what: str) -> str:
    """``value`` if it can be written as UTF-8: a lone surrogate (JSON's ``"\\ud800"``, or
    undecodable bytes a caller smuggled in) is refused here, at the boundary, instead of
    breaking every later read of whatever stored it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (a lone surrogate)") from None
    return value


def parse_size(value: int | str) -> int:
    """``"512Mi"``, ``"1Gi"``, ``"100M"`` or a byte count -> bytes."""
    if isinstance(value, bool):
        raise ValueError("size must be a number of bytes or a string like '512Mi'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(f"cannot parse size {value!r}; use bytes or e.g. '512Mi', '1Gi'")
        number = float(m.group(1))
        if not math.isfinite(number):
            raise ValueError(f"cannot parse size {value!r}")
        n = int(number * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    if n > _MAX_SIZE:
        raise ValueError(f"size {value!r} is larger than any machine (max 1 EiB)")
    return n


class HeaderInjection(BaseModel):
    """Headers the node's egress proxy sets (or replaces) on every HTTPS request the sandbox
    sends to ``domain``, outside gVisor (docs/network.md, "Credential injection"). A value
    may name keys of ``secret`` (a secret of the runtime's :class:`~.secrets.SecretStore`):
    ``$KEY`` or ``${KEY}``, ``$$`` for a literal ``$``. The proxy reads the secret at each
    request, so its values never enter the sandbox and a deleted secret stops at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    domain: str = Field(description="a domain of allow_domains: 'api.example.com' or "
                        "'*.example.com' (its subdomains)")
    headers: dict[str, str] = Field(description="header name -> value template")
    secret: str | None = Field(None, description="the secret whose keys the values name")

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str) -> str:
        return _valid_domain(v)

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        return None if v is None else secrets.check_name(v)

    @model_validator(mode="after")
    def _templates(self) -> HeaderInjection:
        if not 0 < len(self.headers) <= secrets.MAX_HEADERS:
            raise ValueError(f"headers: 1 to {secrets.MAX_HEADERS} per domain")
        for name, value in self.headers.items():
            keys = secrets.check_header(name, value)
            if keys and self.secret is None:
                raise ValueError(f"header {name!r} names ${keys[0]}: give the secret= that "
                                 "holds it")
        return self


def _valid_domain(d: str) -> str:
    d2 = d.strip().lower().rstrip(".")
    if not d2 or len(d2) > 253 or not _DOMAIN_RE.match(d2):
        raise ValueError(f"invalid domain {d!r}")
    return d2


def covers(pattern: str, allowed: tuple[str, ...]) -> bool:
    """Whether every name ``pattern`` matches is matched by one of ``allowed`` (the
    ``allow_domains`` syntax: ``a.b`` itself, ``*.a.b`` its subdomains only)."""
    wild = pattern.startswith("*.")
    base = pattern[2:] if wild else pattern
    for a in allowed:
        if a == pattern:
            return True
        if a.startswith("*.") and (base.endswith("." + a[2:]) or (wild and base == a[2:])):
            return True
    return False


MAX_INJECT_RULES = 64


class EgressPolicy(BaseModel):
    """Where a ``public``/``sandbox`` network may connect to, enforced outside gVisor.

    Private, link-local (cloud metadata), CGNAT, multicast and the node's own addresses are
    denied unless listed in ``allow_cidrs``; ``allow_domains`` admits the addresses those
    names resolve to through the sandbox's resolver. ``deny_cidrs`` wins over everything.
    ``inject`` sets headers on HTTPS requests to some of ``allow_domains`` through the
    node's egress proxy, with values the sandbox never sees (a sandbox created with it
    trusts the proxy's CA).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_cidrs: tuple[str, ...] = ()
    deny_cidrs: tuple[str, ...] = ()
    allow_domains: tuple[str, ...] = ()
    default: Literal["allow", "deny"] = Field(
        "allow", description="verdict for public addresses not matched by any rule"
    )
    private_domains: bool = Field(
        True, description="whether answers for allow_domains may open private addresses "
        "(RFC 1918, CGNAT, ULA: an internal service); False keeps the private tier closed "
        "to names too (the service sets it for tenants)")

    @field_validator("allow_cidrs", "deny_cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for c in v:
            try:
                out.append(str(ipaddress.ip_network(c, strict=False)))
            except ValueError as exc:
                raise ValueError(f"invalid CIDR {c!r}") from exc
        return tuple(out)

    inject: tuple[HeaderInjection, ...] = Field(
        (), description="headers set on HTTPS requests to allowed domains by the node's "
        "egress proxy, from secrets the sandbox never sees (docs/network.md)")

    @field_validator("allow_domains")
    @classmethod
    def _domains(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_valid_domain(d) for d in v)

    @model_validator(mode="after")
    def _inject(self) -> EgressPolicy:
        if len(self.inject) > MAX_INJECT_RULES:
            raise ValueError(f"inject: at most {MAX_INJECT_RULES} rules")
        seen = set()
        for rule in self.inject:
            if rule.domain in seen:
                raise ValueError(f"inject: {rule.domain!r} twice; give its headers in one rule")
            seen.add(rule.domain)
            if not covers(rule.domain, self.allow_domains):
                raise ValueError(f"inject: {rule.domain!r} is not in allow_domains")
        return self


VOLUME_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class VolumeMount(BaseModel):
    """A named volume (``runtime/volumes.py``) mounted into a sandbox. In ``volumes=`` a
    plain ``"name"`` or ``"name:ro"`` is accepted for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    readonly: bool = False
    tools: bool = Field(
        False, description="a tool bundle: its bin/ is appended to every command's PATH, "
        "after the image's own directories (nothing else of its environment is set)")
    on_delete: Literal["retain", "delete"] = Field(
        "retain", description="what happens to the volume when this sandbox ends (delete, "
        "TTL, idle timeout, its owner's death): kept, or deleted with its data once no "
        "sandbox has it mounted (a volume another sandbox still uses is kept)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not VOLUME_NAME_RE.match(v):
            raise ValueError(f"volume name {v!r}: 1-63 of a-z 0-9 _ . -, starting with a "
                             "letter or digit")
        return v


class SandboxConfig(BaseModel):
    """Everything that describes one sandbox. Immutable; build variants with ``model_copy``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    image: str = DEFAULT_IMAGE
    cpu: float | None = Field(1.0, description="CPU quota in cores; None or 0 = unlimited")
    memory: int | None = Field(512 * 2**20, description="memory limit in bytes; '512Mi' accepted")
    disk: int | Literal["unlimited"] | None = Field(
        None,
        description="bytes the sandbox may write to the node's disk (writable root and "
        "workdir), enforced by a loop-mounted ext4 of that size: writes beyond fail with "
        "ENOSPC inside; '1Gi' accepted; None = the default cap (4 GiB, see effective_disk); "
        "'unlimited' = no cap (the host directory is then mounted nosuid,nodev)",
    )
    pids_limit: int | Literal["auto"] | None = Field(
        "auto",
        description="host tasks (processes + threads) the sandbox may use; on ptrace each "
        "guest process costs ~9. Reaching it stops the whole sandbox (reason PidsLimit). "
        "'auto' = sized on the node from its pid_max (see node_pids_limit); None = "
        "unbounded, which lets one sandbox exhaust the node's pid_max",
    )
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    volumes: dict[str, VolumeMount] = Field(
        default_factory=dict,
        description="absolute path in the sandbox -> a named volume that exists on the node "
        "('name', 'name:ro' or {name, readonly}); its data outlives the sandbox",
    )
    shell: str | None = Field(
        None, description="the shell a string command runs through (``shell -c``); None = "
        "/bin/sh (Ray's sandboxes default to /bin/bash, which busybox images lack)"
    )
    readonly: bool = True
    capabilities: tuple[str, ...] | None = Field(
        None, description="None = Docker's default set; () = none"
    )
    user: str | None = Field(None, description="'name', 'uid' or 'uid:gid'; None = image USER")
    ttl_seconds: float | None = Field(None, description="wall-clock lifetime; None = forever")
    idle_timeout_seconds: float | None = Field(
        None, description="deleted after this long without a call into it (exec, files, "
        "run_python, spawn) while no exec or spawned process runs (Modal's idle_timeout); "
        "enforced by the process that owns it (a node's host); None = never")
    idle_suspend_seconds: float | None = Field(
        None, description="suspended after this long without a call into it (the same use "
        "as idle_timeout_seconds): its memory and Ray reservation are released, its "
        "processes, files, network address, published ports, links and volumes kept on "
        "the node, and the next call of any kind resumes it first (docs/snapshots.md, "
        "'Idle suspend'); network 'none' or 'sandbox' only (runsc cannot checkpoint the "
        "host's sockets); None = never")
    timeout_seconds: float | None = Field(300.0, description="default timeout for exec calls")
    network: NetworkMode = "none"
    dns: tuple[str, ...] | None = None
    egress: EgressPolicy | None = None
    expose_ports: tuple[int, ...] = ()
    pull_network: PullNetwork = Field(
        "node",
        description="where the node pulls the image from, if it must: 'node' = its own "
        "network (whatever the registry, its auth realm or a redirect names, the node's "
        "loopback included); 'public' = a network namespace of the pull's own whose "
        "connections reach only public addresses (the 'public' network mode's egress, "
        "checked by the kernel at every connection; needs root). A stored image is not "
        "pulled again either way (docs/images.md, 'Pulls that reach only public addresses')",
    )
    rootless: bool | Literal["auto"] = "auto"
    platform: Platform = "ptrace"
    directfs: bool = Field(
        True,
        description="gVisor's directfs (runsc's default): the sentry opens the sandbox's "
        "files itself, so it runs as root with the container's capabilities. False "
        "(hardening): the gofer serves every file and the sentry runs as host uid 65534 with "
        "no capabilities, with network 'none' or 'sandbox'; with 'public' it stays uid 0 in "
        "an identity-mapped user namespace of its own, with 'host' in the node's "
        "(docs/security.md)",
    )
    docker: bool = Field(
        False,
        description="run a Docker daemon inside the sandbox (docs/docker.md): needs "
        "readonly=False, an image with dockerd (ray-sandbox/docker), and not network 'host'; "
        "/var/lib/docker is a tmpfs of disk= bytes (default memory=) counted in memory=",
    )
    labels: dict[str, str] = Field(default_factory=dict)
    spec_transform: Callable[[dict[str, Any]], dict[str, Any] | None] | None = Field(
        None,
        validation_alias=AliasChoices("spec_transform", "_oci_spec_transform_fn"),
        exclude=True,
    )

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _size(cls, v: Any, info: Any) -> Any:
        # memory=0 means no limit, as in Ray's sandboxes (and cpu=0 here)
        if info.field_name == "memory" and v == 0 and not isinstance(v, bool):
            return None
        if info.field_name == "disk" and v == UNLIMITED:
            return v
        return None if v is None else parse_size(v)

    @field_validator("memory")
    @classmethod
    def _min_memory(cls, v: int | None) -> int | None:
        if v is not None and v < 32 * 2**20:
            raise ValueError("memory must be at least 32Mi (gVisor itself needs ~25 MiB)")
        return v

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: float | None) -> float | None:
        if v == 0:
            return None  # like Ray's num_cpus=0: nothing reserved, no quota
        if v is not None and not (0.01 <= v <= 1024):
            raise ValueError("cpu must be between 0.01 and 1024 cores")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v or v.strip() != v or any(c in v for c in " \t\n\0"):
            raise ValueError(f"invalid image reference {v!r}")
        return check_text(v, "the image reference")

    @field_validator("labels", mode="after")
    @classmethod
    def _label_text(cls, v: dict[str, str]) -> dict[str, str]:
        # names shown everywhere (listings, JSON, the service): plain Unicode only; env and
        # paths may carry undecodable bytes as surrogates (os.fsdecode), as the OS allows
        for k, val in v.items():
            check_text(k, "a label key")
            check_text(val, f"label {k!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not _ENV_NAME_RE.match(k):
                raise ValueError(f"invalid environment variable name {k!r}")
            if "\0" in val:
                raise ValueError(f"environment variable {k!r} contains a NUL byte")
        return v

    @field_validator("shell")
    @classmethod
    def _shell(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or any(c in v for c in " \t\n\0")):
            raise ValueError(f"shell must be an absolute path such as /bin/bash, got {v!r}")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else cls._sandbox_dir(v)

    @staticmethod
    def _sandbox_dir(v: str) -> str:
        """A directory inside the sandbox a workdir or a volume may name: absolute, outside the
        system directories; returned normalized."""
        if not v.startswith("/") or "\0" in v:
            raise ValueError("workdir must be an absolute path")
        norm = os.path.normpath(v)
        system = ("/proc", "/sys", "/dev", AGENT_DIR)
        if norm == "/" or norm in system or norm.startswith(tuple(d + "/" for d in system)):
            raise ValueError(f"workdir {v!r} cannot be a system directory")
        return norm

    @field_validator("volumes", mode="before")
    @classmethod
    def _volume_shorthand(cls, v: Any) -> Any:
        if not isinstance(v, Mapping):
            return v
        out = {}
        for path, vol in v.items():
            if isinstance(vol, str):
                name, _, mode = vol.partition(":")
                if mode not in ("", "ro", "rw"):
                    raise ValueError(f"volume {vol!r}: the mode after ':' is 'ro' or 'rw'")
                vol = {"name": name, "readonly": mode == "ro"}
            out[path] = vol
        return out

    @field_validator("volumes")
    @classmethod
    def _volume_paths(cls, v: dict[str, VolumeMount]) -> dict[str, VolumeMount]:
        out: dict[str, VolumeMount] = {}
        for path, vol in v.items():
            norm = cls._sandbox_dir(path)
            if norm in out:
                raise ValueError(f"two volumes at {norm}")
            out[norm] = vol
        paths = sorted(out)
        for a, b in zip(paths, paths[1:], strict=False):
            if b.startswith(a + "/"):
                raise ValueError(f"volume at {b} is inside the one at {a}")
        return out

    @field_validator("capabilities", mode="before")
    @classmethod
    def _caps(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            raise ValueError("capabilities must be a list of names such as ['CAP_CHOWN']")
        out = []
        for c in v:
            name = str(c).upper()
            name = name if name.startswith("CAP_") else "CAP_" + name
            if name not in _KNOWN_CAPS:
                raise ValueError(f"unknown capability {c!r}")
            out.append(name)
        return tuple(dict.fromkeys(out))

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c in v for c in " \t\n\0/")):
            raise ValueError(f"invalid user {v!r}")
        return v

    @field_validator("ttl_seconds", "timeout_seconds", "idle_timeout_seconds",
                     "idle_suspend_seconds")
    @classmethod
    def _positive(cls, v: float | None, info: Any) -> float | None:
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError("must be a positive, finite number of seconds")
        limit = MAX_TIMEOUT if info.field_name == "timeout_seconds" else MAX_TTL
        if v is not None and v > limit:
            raise ValueError(f"must be at most {limit:.0f} seconds")
        return v

    @field_validator("dns")
    @classmethod
    def _dns(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        for a in v:
            try:
                ipaddress.ip_address(a)
            except ValueError as exc:
                raise ValueError(f"dns entries must be IP addresses, got {a!r}") from exc
        return v

    @field_validator("expose_ports")
    @classmethod
    def _ports(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for p in v:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} is out of range 1-65535")
        if len(set(v)) != len(v):
            raise ValueError("expose_ports has duplicates")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not k or len(k) > 253:
                raise ValueError(f"invalid label key {k!r}")
        return v

    @field_validator("pids_limit")
    @classmethod
    def _pids(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 256:
            raise ValueError("pids_limit below 256 leaves gVisor itself no room (it needs ~30)")
        return v

    @field_validator("disk")
    @classmethod
    def _disk(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < _MIN_DISK:
            # mkfs.ext4 itself works down to 128 KiB; below 1 MiB its metadata is a large
            # share and no sandbox is useful (docs/runtime.md, "Limits").
            raise ValueError("disk must be at least 1Mi")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> SandboxConfig:
        if self.dns is not None and self.network in ("none", "host"):
            raise ValueError(f"dns= has no effect with network={self.network!r}")
        if self.egress is not None and self.network not in ("public", "sandbox"):
            raise ValueError("egress= needs network='public' or 'sandbox'")
        if self.expose_ports and self.network not in ("public", "sandbox"):
            raise ValueError("expose_ports= needs network='public' or 'sandbox'")
        if self.network == "sandbox" and self.effective_rootless:
            raise ValueError("network='sandbox' needs rootful mode (rootless=False, as root)")
        if self.idle_suspend_seconds is not None and self.network in ("public", "host"):
            raise ValueError(f"idle_suspend_seconds needs network 'none' or 'sandbox': runsc "
                             f"cannot checkpoint the host's sockets that {self.network!r} uses")
        if isinstance(self.disk, int) and self.effective_rootless:
            raise ValueError("disk= needs rootful mode (a loop-mounted filesystem; as root)")
        if self.rootless is False and os.geteuid() != 0:
            raise ValueError("rootless=False needs root")
        if self.docker:
            self._docker_combinations()
        return self

    def _docker_combinations(self) -> None:
        """What ``docker=True`` cannot work with (docs/docker.md, "What does not work")."""
        if self.readonly:
            raise ValueError("docker=True needs readonly=False (dockerd writes /run, /etc "
                             "and /var/lib)")
        if self.network == "host":
            raise ValueError("docker=True cannot use network='host': runsc would run the "
                             "sentry in the node's user namespace with CAP_SYS_ADMIN and "
                             "CAP_NET_ADMIN; use 'public' or 'sandbox'")
        if self.effective_rootless:
            raise ValueError("docker=True needs rootful mode (rootless=False, as root)")
        if self.memory is not None and self.memory < DOCKER_MIN_MEMORY:
            raise ValueError("docker=True needs memory of at least 256Mi (dockerd and "
                             "containerd alone take ~60 MiB)")
        if self.capabilities is not None:
            missing = [c for c in DOCKER_IN_SANDBOX_CAPABILITIES if c not in self.capabilities]
            if missing:
                raise ValueError(f"docker=True needs the capabilities {', '.join(missing)}")

    @property
    def effective_rootless(self) -> bool:
        """``rootless="auto"`` is rootful as root (sandbox runs as an unprivileged host uid)."""
        return os.geteuid() != 0 if self.rootless == "auto" else bool(self.rootless)

    @property
    def writes_to_disk(self) -> bool:
        """Whether the sandbox writes to the node's disk at all: a writable root (runsc's
        filestore) or a read-only root's workdir (a bind); else only memory-bounded tmpfs."""
        return not self.readonly or bool(self.workdir)

    @property
    def effective_disk(self) -> int | None:
        """The cap on what the sandbox writes to the node's disk: ``disk=``, else
        ``DEFAULT_DISK``; None for ``disk="unlimited"``, for a sandbox that writes nothing
        there, and rootless (a loop-mounted filesystem needs root; docs/runtime.md)."""
        if not self.writes_to_disk or self.disk == UNLIMITED:
            return None
        if isinstance(self.disk, int):
            return self.disk
        return None if self.effective_rootless else DEFAULT_DISK

    @property
    def effective_capabilities(self) -> tuple[str, ...]:
        if self.capabilities is not None:
            return self.capabilities
        return DOCKER_IN_SANDBOX_CAPABILITIES if self.docker else DOCKER_DEFAULT_CAPABILITIES


# What a running, never-used sandbox can still take on when it is handed out (the record,
# the exec defaults, an nft policy): everything else shapes its boot.
PERSONAL_FIELDS = frozenset({"env", "labels", "ttl_seconds", "timeout_seconds", "user",
                             "workdir", "egress", "shell", "idle_timeout_seconds",
                             "idle_suspend_seconds",
                             "pull_network"})  # how its image was fetched: before any boot


def boot_key(cfg: SandboxConfig) -> str | None:
    """What a sandbox booted for ``cfg`` shares with every other config of the same key, so
    that one booted ahead of time can serve it; None if none can (a spec transform is code,
    a read-only sandbox's workdir is a bind made at boot, so are volumes)."""
    if cfg.spec_transform is not None or (cfg.readonly and cfg.workdir) or cfg.volumes:
        return None  # a volume is mounted at boot, and a read-write one is held while mounted
    if cfg.expose_ports:
        return None  # a stocked copy would hold the node's ports before anyone asked for them
    if cfg.egress is not None and cfg.egress.inject:
        return None  # it trusts its proxy's CA from boot on; a stocked copy trusts none
    boot = cfg.model_dump(mode="json", exclude=set(PERSONAL_FIELDS))
    return json.dumps(boot, sort_keys=True, separators=(",", ":"))


def auto_pids_limit(pid_max: int, density: int = PLANNED_DENSITY) -> int:
    """The ``pids_limit="auto"`` value: half of ``pid_max`` over ``density`` sandboxes,
    within 1024..4096. ``scripts/setup.sh`` raises a stock pid_max of 32768 to 4194304, which
    makes it 4096."""
    lo, hi = _AUTO_PIDS
    return max(lo, min(hi, pid_max // (2 * max(1, density))))


def node_pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 32768  # the kernel's default


def node_pids_limit() -> int:
    """``auto_pids_limit`` for this node's pid_max; the planned density is
    ``RAY_SANDBOX_PLANNED_DENSITY`` (default 32)."""
    pid_max = node_pid_max()
    try:
        density = int(os.environ.get("RAY_SANDBOX_PLANNED_DENSITY", PLANNED_DENSITY))
    except ValueError:
        raise ConfigError("RAY_SANDBOX_PLANNED_DENSITY must be an integer") from None
    return auto_pids_limit(pid_max, density)


def make_config(
    config: SandboxConfig | Mapping[str, Any] | None = None, **overrides: Any
) -> SandboxConfig:
    """Build a validated :class:`SandboxConfig` from a config and/or keyword arguments.

    Raises :class:`ConfigError` naming the offending field(s).
    """
    try:
        if config is None:
            return SandboxConfig(**overrides)
        if isinstance(config, SandboxConfig):
            if not overrides:
                return config
            data = config.model_dump(exclude_unset=True)
            if config.spec_transform is not None:
                data["spec_transform"] = config.spec_transform
            return SandboxConfig(**{**data, **overrides})
        return SandboxConfig(**{**dict(config), **overrides})
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "config"
            msg = "unknown option" if e["type"] == "extra_forbidden" else e["msg"]
            msgs.append(f"{loc}: {msg}")
        raise ConfigError("invalid sandbox config: " + "; ".join(msgs)) from None
    except TypeError as exc:
        raise ConfigError(f"invalid sandbox config: {exc}") from None
