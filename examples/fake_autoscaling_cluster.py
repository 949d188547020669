"""A local autoscaling Ray cluster (Ray's fake multi-node provider) that cleans up after itself.

``ray.cluster_utils.AutoscalingCluster`` cannot be used as shipped in Ray 2.60:

- its ``start()``/``shutdown()`` run ``ray stop --force``, which kills every Ray process on the
  machine by name, not just this cluster's;
- it reads ``autoscaler/_private/fake_multi_node/example.yaml``, which the wheel does not ship
  (the ``fake_multinode`` provider type loads its defaults from that file too);
- the provider passes a node type's ``memory`` to ``RayParams`` as a custom resource, which
  ``RayParams`` refuses, so sandboxes that reserve memory would never trigger a scale-up.

So the head runs in a child process of its own (this file, run as a script). It writes a
complete config using the ``external`` provider type pointing at :class:`MemoryAwareFakeProvider`,
becomes a child subreaper so every process the cluster starts (worker nodes are started by the
autoscaler process, and some of their processes outlive a scale-down) stays its descendant, and
on exit kills exactly those descendants, by PID. Its stdin is the lifeline: when the parent
closes it, or dies, the cluster goes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import (
    FAKE_HEAD_NODE_ID,
    FakeMultiNodeProvider,
)

HEAD_TYPE = "ray.head.default"
_PR_SET_CHILD_SUBREAPER = 36


class MemoryAwareFakeProvider(FakeMultiNodeProvider):
    """The fake provider, minus the ``memory`` it cannot pass on: the fake node then reports
    this machine's memory. The autoscaler still plans with the node type's declared memory,
    which is what matters for deciding to scale."""

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        resources = {k: v for k, v in resources.items() if k != "memory"}
        return super().create_node_with_resources_and_labels(
            node_config, tags, count, resources, labels)


def autoscaling_config(gcs_address: str, worker_types: dict[str, dict[str, Any]],
                       idle_timeout_s: float) -> dict[str, Any]:
    """A full cluster config (every key ``prepare_config`` reads) for the autoscaler v2."""
    types = {HEAD_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
             **{name: {"node_config": {}, "min_workers": 0, **t}
                for name, t in worker_types.items()}}
    return {
        "cluster_name": "ray-sandbox-fake",
        "max_workers": sum(t.get("max_workers", 0) for t in worker_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "external",
            "module": f"{Path(__file__).stem}.{MemoryAwareFakeProvider.__name__}",
            "gcs_address": gcs_address,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
        },
        "head_node_type": HEAD_TYPE,
        "available_node_types": types,
        "docker": {}, "auth": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _descendants(root: int) -> list[int]:
    """PIDs below ``root`` in the process tree, deepest last."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_descendants() -> None:
    for _ in range(50):
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.1)


def _head_main(port: int, temp_dir: str, config: str) -> None:
    from ray.cluster_utils import Cluster

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.environ.update({
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_FAKE_CLUSTER": "1",
        "RAY_enable_autoscaler_v2": "1",
        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
        "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        # the autoscaler process imports MemoryAwareFakeProvider from this directory
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                    os.environ.get("PYTHONPATH")])),
    })
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # cleans up in the finally below
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "autoscaling_config": config,
            "gcs_server_port": port, "temp_dir": temp_dir,
        })
        print(cluster.address, flush=True)
        sys.stdin.read()  # until the parent closes it or dies
    finally:
        if cluster is not None:
            cluster.shutdown()
        _kill_descendants()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class FakeCluster:
    address: str
    temp_dir: str  # every process of the cluster has it on its command line


@contextmanager
def fake_autoscaling_cluster(worker_types: dict[str, dict[str, Any]], *,
                             idle_timeout_s: float = 6.0,
                             start_timeout_s: float = 120.0) -> Iterator[FakeCluster]:
    """Start a head with no CPUs and an autoscaler that launches ``worker_types`` nodes
    (``{"name": {"resources": {...}, "max_workers": n}}``) on demand and removes them after
    ``idle_timeout_s`` idle. Stops every process of the cluster on exit."""
    import ray

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="rsb-as-") as tmp:
        config = Path(tmp) / "autoscaling.json"
        address = f"{ray.util.get_node_ip_address()}:{port}"
        config.write_text(json.dumps(autoscaling_config(address, worker_types, idle_timeout_s)))
        head = subprocess.Popen(
            [sys.executable, __file__, str(port), tmp, str(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            line = _readline(head, start_timeout_s)
            if not line:
                raise RuntimeError(f"the fake cluster's head exited ({head.wait()})")
            yield FakeCluster(line.strip(), tmp)
        finally:
            head.stdin.close()
            try:
                head.wait(timeout=90)
            except subprocess.TimeoutExpired:
                head.kill()  # its descendants then see their parent die and the GCS go
                head.wait()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"the fake cluster's head did not start in {timeout}s")
    return proc.stdout.readline()


if __name__ == "__main__":
    _head_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
