"""Docker inside a sandbox (``docker=True``, docs/docker.md): what the spec adds for it and
the start of the daemon, once the agent answers.

What Docker needs under runsc 0.0~20240729, as measured here (docs/docker.md, "How it
works") and as gVisor's "Docker in gVisor" tutorial and its ``images/basic/docker/
start-dockerd.sh`` say:

- capabilities: ``config.DOCKER_IN_SANDBOX_CAPABILITIES`` (the config's default with docker);
- cgroups: gVisor's own cgroupfs mounted at ``/sys/fs/cgroup`` (a spec mount of type
  ``cgroup``: the sentry emulates it, the host's cgroups are not reachable through it);
- storage: ``overlay2`` on a tmpfs at ``/var/lib/docker``. gVisor accepts only a tmpfs as the
  upper layer of an overlay mount; on the sandbox's root overlay dockerd falls back to
  ``vfs``, which copies the whole image for every container (12-16 s per ``docker run`` of
  a 173 MB image against 1.1 s on the tmpfs). The tmpfs lives in the sandbox's memory;
  ``disk=`` (else ``memory=``) caps its size;
- network: ``dockerd --iptables=false --ip6tables=false`` (gVisor has no netfilter tables
  for it: ``iptables-legacy`` says "Table does not exist", ``iptables-nft`` "Protocol not
  supported"); in network ``public`` (runsc ``--network=host``, the host's stack) no bridge
  can be made nor ``ip_forward`` set, so ``--bridge=none --ip-forward=false``, and nested
  containers need ``--network=host``;
- no ``runsc --net-raw``: gVisor's tutorial asks for it (Docker 28+ sends ARP through packet
  sockets), but Docker 20.10 runs, builds, bridges and composes here without it, and it
  would give every process in the sandbox raw sockets (tests/test_docker.py passes either way).
"""

from __future__ import annotations

import shlex

from . import image_builders
from .agent.client import AgentClient
from .config import SandboxConfig
from .errors import SandboxCreationError, SandboxError
from .images import LOCAL_NAMESPACE
from .images.store import LOCAL_IMAGES
from .spec import Mount

DOCKER_IMAGE = f"{LOCAL_NAMESPACE}/docker:latest"
# The store builds local images from this table (images/store.py). The entry is added here,
# with the rest of the Docker support, because every path to a sandbox (launch), the CLI
# and the tests import this module; it belongs in the table itself (docs/docker.md).
LOCAL_IMAGES.setdefault(DOCKER_IMAGE, image_builders.write_docker_layout)
DOCKER_ROOT = "/var/lib/docker"
CGROUP_ROOT = "/sys/fs/cgroup"
DOCKERD_LOG = "/var/log/rsb-dockerd.log"
DOCKER_SOCKET = "/var/run/docker.sock"
START_TIMEOUT = 60.0  # measured: ~2 s on an idle node, ~5 s on a busy one
_LOG_TAIL_LINES = 40


def mounts(config: SandboxConfig) -> list[Mount]:
    """The spec mounts a Docker sandbox adds: gVisor's cgroupfs and the storage tmpfs."""
    size = config.disk or config.memory
    options = ["nosuid", "nodev", "mode=0711"] + ([f"size={size}"] if size else [])
    return [
        Mount(destination=CGROUP_ROOT, type="cgroup", source="cgroup",
              options=["nosuid", "noexec", "nodev"]),
        Mount(destination=DOCKER_ROOT, type="tmpfs", source="tmpfs", options=options),
    ]  # fmt: skip


def dockerd_argv(network: str) -> list[str]:
    """dockerd's command line for a sandbox in network mode ``network``."""
    argv = ["dockerd", "--iptables=false", "--ip6tables=false", "--storage-driver=overlay2",
            f"--data-root={DOCKER_ROOT}"]
    if network == "public":
        # runsc --network=host: the sentry uses the host's stack in the sandbox's netns,
        # where no bridge can be made and /proc/sys/net/ipv4/ip_forward is read-only
        # ("Enabling IP forwarding failed: ... permission denied" ends dockerd otherwise).
        argv += ["--bridge=none", "--ip-forward=false"]
    return argv


def start_script(network: str) -> str:
    """A shell script that starts dockerd in its own session, its output in DOCKERD_LOG,
    and returns once the daemon answers (non-zero, with the log's tail, if it dies or
    START_TIMEOUT passes). A daemon that already answers is left alone."""
    dockerd = shlex.join(dockerd_argv(network))
    tries = int(START_TIMEOUT / 0.05)
    return f"""
if [ -S {DOCKER_SOCKET} ] && docker version >/dev/null 2>&1; then exit 0; fi
command -v dockerd >/dev/null || {{ echo "no dockerd in this image's PATH" >&2; exit 127; }}
mkdir -p "$(dirname {DOCKERD_LOG})"
setsid {dockerd} >>{DOCKERD_LOG} 2>&1 </dev/null &
pid=$!
i=0
until [ -S {DOCKER_SOCKET} ] && docker version >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "dockerd exited" >&2; tail -n {_LOG_TAIL_LINES} {DOCKERD_LOG} >&2; exit 1
  fi
  i=$((i + 1))
  if [ "$i" -gt {tries} ]; then
    echo "dockerd did not answer within {START_TIMEOUT:g}s" >&2
    tail -n {_LOG_TAIL_LINES} {DOCKERD_LOG} >&2; exit 1
  fi
  sleep 0.05
done
"""


def start(client: AgentClient, sandbox_id: str, network: str) -> None:
    """Start dockerd in a booted sandbox and wait until it answers; a SandboxCreationError
    with dockerd's log tail if it does not."""
    try:
        res = client.exec(["/bin/sh", "-c", start_script(network)],
                          timeout=START_TIMEOUT + 10)
    except SandboxError as exc:
        raise SandboxCreationError(f"starting dockerd failed: {exc.message}",
                                   sandbox_id=sandbox_id) from exc
    if res.exit_code != 0:
        raise SandboxCreationError(
            f"dockerd did not start (exit {res.exit_code}); is the image ray-sandbox/docker "
            "or one with docker.io?", sandbox_id=sandbox_id, stderr=res.stderr[-4000:],
        )
