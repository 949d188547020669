"""A sandbox's directory on the node and the OCI bundle inside it.

``home()/sandboxes/<id>/`` holds everything one sandbox owns on the host:

    record.json        SandboxRecord: config, image, owner, runsc flags (the source of truth
                       for every process on the node, so state survives the creator)
    bundle/config.json the OCI spec runsc reads
    root/              the sandbox's root: an overlay mount of the shared image rootfs with
    upper/, ovwork/    a private upper layer (runsc creates mount points there, never in the
                       shared image)
    run/               bind-mounted rw at /.rsb/run; the agent creates its socket here
    etc/               generated hosts, resolv.conf, hostname (bind-mounted per file);
                       ca-bundle.crt with EgressPolicy.inject: the image's CA bundle plus the
                       sandbox's egress proxy CA, bind-mounted read-only over the system bundle
    inject-ca.pem,     with EgressPolicy.inject: the proxy's CA (network/ca.py) and its key
    inject-ca-key.pem  (0600), which only the host's network helper reads
    work/              the writable workdir of a read-only sandbox
    overlay/           runsc's filestore for the private copy-on-write root (readonly=False)
    disk.img, disk/    a sparse ext4 image of the disk cap, loop-mounted (nosuid,nodev) on
                       disk/; work/ and overlay/ then live in disk/ (runtime/disk.py)
    storage/           with disk="unlimited" instead: a nosuid,nodev bind of itself holding
                       work/ and overlay/
    volumes/<i>        with volumes=: a bind of each named volume, bound in at its path
                       (read-only ones read-only on the host; runtime/volumes.py)
    runsc.out/.err     stdio of the detached sandbox

Deleting the directory deletes the sandbox's files; nothing of a sandbox lives elsewhere except
runsc's own state (in ``home()/runsc``), its cgroups and (for some modes) its network namespace.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _mount, docker, procfs
from .config import SandboxConfig, node_pids_limit
from .errors import SandboxCreationError
from .secrets import CA_FILE
from .spec import (
    Capabilities,
    CpuResources,
    IDMapping,
    Linux,
    MemoryResources,
    Mount,
    Namespace,
    PidsResources,
    Process,
    Resources,
    Root,
    Seccomp,
    SeccompArg,
    SeccompSyscall,
    Spec,
    User,
)

AGENT_DIR = "/.rsb/bin"
AGENT_RUN_DIR = "/.rsb/run"
AGENT_SOCKET = f"{AGENT_RUN_DIR}/agent.sock"
AGENT_NAME = "rsb-agent"
# The CFS period of a sandbox's CPU share (docs/runtime.md, "CPU"). The kernel lets a group bank
# at most one quota of unused time (cpu.cfs_burst_us <= quota), so the period sets what a
# sandbox may spend at full speed after idling: 2 x cpu x period, 100 ms of CPU at cpu=0.1
# (about ten `exec true`). A longer period banks more, but stalls a sandbox that used up its
# share for longer, up to (1 - cpu) x period, and loosens the bound over any window W to
# cpu x (W + 2 x period): 1.1 x cpu over 10 s here.
CPU_PERIOD_US = 500_000
RUN_DIR_SIZE = "256k"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
S_IFMT = 0o170000  # the file-type bits of a mode (Python's stat.S_IFMT is a function)
# Every uid/gid a 32-bit id can name except 2^32-1 (the kernel's "no id"), mapped to itself.
IDENTITY_MAP_SIZE = 2**32 - 1
# Credential injection (docs/network.md): the sandbox trusts its egress proxy's CA through
# the system bundle's path, which Debian's and Alpine's OpenSSL, GnuTLS, curl and
# python3-certifi read, and through the variables pip-installed certifi users (requests,
# httpx), curl and Node read; the image's own bundle stays in it.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_BUNDLE_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
_IMAGE_BUNDLES = ("etc/ssl/certs/ca-certificates.crt", "etc/pki/tls/certs/ca-bundle.crt",
                  "etc/ssl/cert.pem")
MAX_IMAGE_BUNDLE = 4 << 20


@dataclass(frozen=True)
class SandboxDir:
    """Paths of one sandbox's host directory."""

    path: Path

    @property
    def record(self) -> Path:
        return self.path / "record.json"

    @property
    def bundle(self) -> Path:
        return self.path / "bundle"

    @property
    def run(self) -> Path:
        return self.path / "run"

    @property
    def socket(self) -> Path:
        return self.run / "agent.sock"

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def upper(self) -> Path:
        return self.path / "upper"

    @property
    def ovwork(self) -> Path:
        return self.path / "ovwork"

    @property
    def etc(self) -> Path:
        return self.path / "etc"

    @property
    def disk_image(self) -> Path:
        return self.path / "disk.img"

    @property
    def disk(self) -> Path:
        return self.path / "disk"

    @property
    def volumes(self) -> Path:
        return self.path / "volumes"

    def volume_binds(self, config: SandboxConfig) -> list[tuple[str, str, bool, Path]]:
        """``(path in the sandbox, volume name, readonly, host bind)`` of each volume."""
        return [(path, vol.name, vol.readonly, self.volumes / str(i))
                for i, (path, vol) in enumerate(config.volumes.items())]

    @property
    def _storage(self) -> Path:
        """Where the sandbox's host-backed writable storage goes: the size-capped filesystem
        if the sandbox has one (its mount point exists only then)."""
        if self.disk.is_dir():
            return self.disk
        store = self.path / "storage"
        return store if store.is_dir() else self.path

    @property
    def ca_bundle(self) -> Path:
        return self.etc / "ca-bundle.crt"

    @property
    def work(self) -> Path:
        return self._storage / "work"

    @property
    def overlay(self) -> Path:
        return self._storage / "overlay"

    def create(self) -> None:
        # 0700: what a sandbox writes here (a workdir, an overlay) is reachable by no other
        # host user, whatever modes, setuid bits or device nodes the sandbox gave it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(mode=0o700, exist_ok=False)
        os.chmod(self.path, 0o700)  # mkdir's mode is masked by the umask
        for d in (self.bundle, self.run, self.etc):
            d.mkdir()
        # run/ is bind-mounted writable into the sandbox (the agent's socket lives there): a
        # small tmpfs keeps whatever the sandbox writes there off the node's disk.
        _mount.mount_tmpfs(self.run, size=RUN_DIR_SIZE)

    def storage_unlimited(self) -> None:
        """Without a capped disk (``disk="unlimited"``): the directory the sandbox writes to
        is a bind of itself mounted nosuid,nodev, as the capped disk is, so a setuid file or
        a device node the sandbox makes there means nothing on the host."""
        store = self.path / "storage"
        store.mkdir(mode=0o700)
        _mount.bind(store, store, readonly=False, sandbox_id=self.path.name, harden=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def hosts_file(hostname: str) -> str:
    return (
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"127.0.1.1\t{hostname}\n"
    )


def _rootfs_path(rootfs: Path, path: str) -> Path:
    """``path`` inside the image, without following symlinks out of the rootfs."""
    return rootfs / path.lstrip("/")


def seed_workdir(rootfs: Path, workdir: str, dest: Path, *, sandbox_id: str) -> None:
    """Copy the image's content at ``workdir`` (if any) into the sandbox's own writable dir."""
    src = _rootfs_path(rootfs, workdir)
    try:
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dest, symlinks=True)
        else:
            dest.mkdir()
    except OSError as exc:  # e.g. the image's workdir is larger than disk=
        raise SandboxCreationError(
            f"copying the image's {workdir} into the sandbox failed: {str(exc)[:500]}",
            sandbox_id=sandbox_id,
        ) from None


def no_device_nodes() -> Seccomp:
    """gVisor does not check CAP_MKNOD: without this filter a sandbox with no capabilities
    can still make character and block device nodes. It refuses exactly those with EPERM,
    as Linux does without the capability; FIFOs, sockets and regular files stay allowed.
    The mode is ``mknod``'s argument 1 and ``mknodat``'s argument 2; masking with S_IFMT
    ignores permission bits and whatever a caller puts in the register's upper bits."""
    return Seccomp(
        defaultAction="SCMP_ACT_ALLOW",
        syscalls=[
            SeccompSyscall(
                names=[name], action="SCMP_ACT_ERRNO", errnoRet=errno.EPERM,
                args=[SeccompArg(index=index, op="SCMP_CMP_MASKED_EQ", value=S_IFMT,
                                 valueTwo=kind)],
            )
            for name, index in (("mknod", 1), ("mknodat", 2))
            for kind in (stat.S_IFCHR, stat.S_IFBLK)
        ],
    )  # fmt: skip


def identity_user_namespace() -> tuple[Namespace, list[IDMapping]]:
    """A user namespace for a ``runsc --network=host`` sandbox in its own netns (``public``).

    With that flag runsc starts the sentry in the user namespace the spec names, else in the
    caller's: the node's, as uid 0 with the container's capabilities + CAP_SYS_PTRACE, whether
    or not directfs is on. With this namespace the sentry's capabilities hold only inside it,
    not over the node. The mapping must be the identity (runsc, as root, refuses anything else
    at start: "cannot read client sync file"); ids keep their meaning, so image files, the
    gofer and directfs behave as before. That namespace does not own the sandbox's netns,
    so the network layer lets any uid bind ports < 1024 there (network/_lifecycle.py).
    """
    mapping = [IDMapping(containerID=0, hostID=0, size=IDENTITY_MAP_SIZE)]
    return Namespace(type="user"), mapping


def build_spec(
    *,
    sandbox_id: str,
    config: SandboxConfig,
    rootfs: Path,
    image_env: list[str],
    sdir: SandboxDir,
    agent_dir: Path,
    netns_path: str | None = None,
    host_network: bool = False,
    with_resolv_conf: bool = False,
) -> Spec:
    """The OCI spec for a sandbox whose PID 1 is the agent.

    Resource limits and capabilities in the spec bound everything in the sandbox: the agent
    (PID 1) and every command it runs inherit them.
    """
    hostname = "sandbox-" + sandbox_id[:8]
    caps = list(config.effective_capabilities)
    mounts = [
        Mount(destination="/proc", type="proc", source="proc"),
        Mount(destination="/dev", type="tmpfs", source="tmpfs",
              options=["nosuid", "strictatime", "mode=755", "size=65536k"]),
        Mount(destination="/dev/pts", type="devpts", source="devpts",
              options=["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]),
        Mount(destination="/dev/shm", type="tmpfs", source="shm",
              options=["nosuid", "noexec", "nodev", "mode=1777"]),
        Mount(destination="/sys", type="sysfs", source="sysfs",
              options=["nosuid", "noexec", "nodev", "ro"]),
        Mount(destination="/tmp", type="tmpfs", source="tmpfs",
              options=["nosuid", "nodev", "mode=1777"]),
        Mount(destination=AGENT_DIR, type="bind", source=str(agent_dir),
              options=["rbind", "ro"]),
        Mount(destination=AGENT_RUN_DIR, type="bind", source=str(sdir.run),
              options=["rbind", "rw"]),
        # Read-only: a writable bind of a host file would let the sandbox fill the disk.
        Mount(destination="/etc/hosts", type="bind", source=str(sdir.etc / "hosts"),
              options=["rbind", "ro"]),
        Mount(destination="/etc/hostname", type="bind", source=str(sdir.etc / "hostname"),
              options=["rbind", "ro"]),
    ]  # fmt: skip
    if with_resolv_conf:
        mounts.append(
            Mount(destination="/etc/resolv.conf", type="bind",
                  source=str(sdir.etc / "resolv.conf"), options=["rbind", "ro"])
        )  # fmt: skip
    if injects(config):
        mounts.append(
            Mount(destination=CA_BUNDLE, type="bind", source=str(sdir.ca_bundle),
                  options=["rbind", "ro"])
        )  # fmt: skip
    if config.readonly and config.workdir:
        mounts.append(
            Mount(destination=config.workdir, type="bind", source=str(sdir.work),
                  options=["rbind", "rw"])
        )  # fmt: skip
    for path, _, readonly, source in sdir.volume_binds(config):
        mounts.append(Mount(destination=path, type="bind", source=str(source),
                            options=["rbind", "ro" if readonly else "rw"]))
    if config.docker:
        mounts += docker.mounts(config)

    resources = Resources()
    if config.memory is not None:
        resources.memory = MemoryResources(limit=config.memory)
    if config.cpu is not None:
        resources.cpu = boot_cpu(config.cpu)
    if config.pids_limit is not None:
        limit = node_pids_limit() if config.pids_limit == "auto" else config.pids_limit
        resources.pids = PidsResources(limit=limit)

    namespaces = [Namespace(type=t) for t in ("pid", "ipc", "uts", "mount")]
    if not host_network or netns_path:
        # Without a path runsc makes a fresh, empty namespace, which would hide the node's
        # network from --network=host.
        namespaces.append(Namespace(type="network", path=netns_path))
    uid_map = None
    if host_network and netns_path:
        # network "public": the sandbox's own netns. Not "host" (trusted code only): the
        # node's netns is owned by the node's user namespace, so the sandbox could no longer
        # bind ports < 1024 there, and allowing that would take a node-wide sysctl.
        userns, uid_map = identity_user_namespace()
        namespaces.append(userns)

    return Spec(
        process=Process(
            terminal=False,
            user=User(uid=0, gid=0),
            args=[f"{AGENT_DIR}/{AGENT_NAME}", "init", f"{AGENT_RUN_DIR}/agent.sock"],
            env=merge_env(image_env, {}),
            cwd="/",
            capabilities=Capabilities(bounding=caps, effective=caps, permitted=caps),
            noNewPrivileges=False,
        ),
        root=Root(path=str(rootfs), readonly=config.readonly),
        hostname=hostname,
        mounts=mounts,
        annotations={"dev.ray-sandbox.id": sandbox_id},
        linux=Linux(namespaces=namespaces, uidMappings=uid_map, gidMappings=uid_map,
                    resources=resources,
                    seccomp=None if "CAP_MKNOD" in caps else no_device_nodes()),
    )


def boot_cpu(cpu: float) -> CpuResources:
    """The spec's CPU limit, which runsc applies from the start: the share, but at least one
    core. gVisor's boot takes ~150 ms of CPU, 1.5 s at a 0.1 share; no user code runs before
    the agent answers, and :func:`apply_cpu_share` narrows it before create returns."""
    return CpuResources(period=CPU_PERIOD_US, quota=round(max(cpu, 1.0) * CPU_PERIOD_US))


def apply_cpu_share(sandbox_id: str, config: SandboxConfig) -> None:
    """Give the sandbox's cgroup its CPU share in place of the boot limit, as soon as user
    code may run: after a create once the agent answers, after a restore as soon as runsc
    returns (the copy's processes resume there; its spec carries the boot limit, or an older
    one). Quota ``cpu`` x period, and a burst of one quota, the most the kernel allows: an
    exec after idle time runs on what the sandbox banked instead of waiting for the next
    period. runsc 0.0~20240729 ignores the spec's ``linux.resources.cpu.burst`` (measured),
    so the host writes it. Rootless sandboxes have no cgroups."""
    if config.cpu is None or config.effective_rootless:
        return
    quota = round(config.cpu * CPU_PERIOD_US)
    procfs.set_cpu_bandwidth(sandbox_id, period_us=CPU_PERIOD_US, quota_us=quota,
                             burst_us=quota)


def merge_env(base: list[str], extra: dict[str, str]) -> list[str]:
    """``KEY=VALUE`` list: ``base`` overridden by ``extra``; PATH defaulted when missing."""
    env: dict[str, str] = {}
    for item in base:
        k, _, v = item.partition("=")
        env[k] = v
    env.update(extra)
    env.setdefault("PATH", DEFAULT_PATH)
    return [f"{k}={v}" for k, v in env.items()]


def injects(config: SandboxConfig) -> bool:
    """Whether the sandbox trusts an egress proxy's CA (created with EgressPolicy.inject)."""
    return config.network in ("public", "sandbox") and config.egress is not None and \
        bool(config.egress.inject)


def ca_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The variables that point TLS clients at the trust bundle of a sandbox created with
    EgressPolicy.inject (``config`` as its record keeps it); {} for any other."""
    egress = config.get("egress") or {}
    if config.get("network") not in ("public", "sandbox") or not egress.get("inject"):
        return {}
    return dict.fromkeys(CA_BUNDLE_ENV, CA_BUNDLE)


def image_ca_bundle(rootfs: Path) -> bytes:
    """The image's CA bundle (the first of the usual paths that is a regular file reached
    without a symlink, at most 4 MiB), or b"": the image's files, read on the host, never
    lead it anywhere else."""
    for rel in _IMAGE_BUNDLES:
        fd = _open_beneath(rootfs, rel)
        if fd is None:
            continue
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                data = f.read(MAX_IMAGE_BUNDLE + 1)
                if len(data) <= MAX_IMAGE_BUNDLE:
                    return data if data.endswith(b"\n") or not data else data + b"\n"
    return b""


def _open_beneath(root: Path, rel: str) -> int | None:
    """``root/rel`` opened one component at a time, refusing every symlink."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    parts = rel.split("/")
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except OSError:
        os.close(fd)
        return None


def write_bundle(sdir: SandboxDir, spec: Spec, *, hostname: str, resolv_conf: str | None,
                 hosts: str | None = None) -> None:
    if any(m.source == str(sdir.ca_bundle) for m in spec.mounts):
        # the proxy's CA (network/ca.py made it at attach) after the image's own
        ca = sdir.path / CA_FILE
        extra = ca.read_bytes() if ca.is_file() else b""
        sdir.ca_bundle.write_bytes(image_ca_bundle(Path(spec.root.path)) + extra)
    (sdir.etc / "hosts").write_text(hosts or hosts_file(hostname))
    (sdir.etc / "hostname").write_text(hostname + "\n")
    if resolv_conf is not None:
        (sdir.etc / "resolv.conf").write_text(resolv_conf)
    tmp = sdir.bundle / "config.json.tmp"
    tmp.write_text(spec.to_json())
    os.replace(tmp, sdir.bundle / "config.json")
