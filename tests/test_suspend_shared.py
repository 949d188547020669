"""A node that dies loses its suspended sandboxes unless their state is on a shared path
(issue 36): with RAY_SANDBOX_SUSPEND_DIR every node writes a suspended sandbox's state there
as a complete snapshot, and once the node is gone ``ray_sandbox.resume`` takes it over on
another node under the same id and name; the dead node, back, removes what it had of it."""

from __future__ import annotations

import json

from ray_sandbox.actor import api
from ray_sandbox.runtime import ImageStore, SandboxRuntime, SandboxState
from tests.fx_hostile import heavy
from tests.fx_ray import homes_cluster
from tests.fx_runtime import NODE_IMAGES


@heavy  # 12 s in CI, a two-node scenario
def test_a_dead_nodes_suspended_sandbox_is_taken_over_from_the_shared_path(
        tmp_path_factory, default_image, busybox_image):
    import ray

    homes = [tmp_path_factory.mktemp(f"rsb-shared{i}") for i in range(2)]
    shared = tmp_path_factory.mktemp("rsb-shared-state")
    args = [{"resources": {f"shnode{i}": 1}} for i in range(2)]
    with homes_cluster(homes, env={"RAY_SANDBOX_SUSPEND_DIR": str(shared)},
                       node_args=args) as cluster:
        nodes = {next(r for r in n["Resources"] if r.startswith("shnode")): n["NodeID"]
                 for n in ray.nodes() if n["Alive"]}
        sb = api.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi", name="castaway",
                        node_id=nodes["shnode1"], lifetime="detached")
        sb.run("echo kept > /root/f")
        ray.get(sb.suspend.remote())
        note = json.loads((shared / sb.sandbox_id / "ray.json").read_text())
        assert (note["node"], note["name"]) == (nodes["shnode1"], "castaway")
        (worker,) = [n for n in cluster.worker_nodes]
        cluster.remove_node(worker)  # node 1 is gone, its home with it (for Ray)
        back = api.resume("castaway")
        assert (back.sandbox_id, back.node_id) == (sb.sandbox_id, nodes["shnode0"])
        assert ray.get(back.exec.remote("cat /root/f")).stdout == "kept\n"
        assert ray.get(back.status.remote()).state == SandboxState.RUNNING
        assert api.get("castaway").sandbox_id == sb.sandbox_id
        assert not any(p.name.startswith(".taken-") for p in shared.iterdir())
        # node 1 comes back: its host (here: a runtime on its home) finds the sandbox taken
        # over and removes what it left there
        rt = SandboxRuntime(homes[1], reap=False, images=ImageStore(NODE_IMAGES))
        assert rt.suspensions.adopt() == []
        rt.close()
        assert not (homes[1] / "sandboxes" / sb.sandbox_id).exists()
        ray.get(back.terminate.remote())
        assert not (shared / sb.sandbox_id).exists()
