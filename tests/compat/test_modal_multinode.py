"""An image of Modal's DSL built once is usable on every node: on a local two-node cluster
(separate homes), the build runs on one node and a sandbox on the other starts from it (the
node fetches it once from the building node's host, as a filesystem image). Heavy: it starts
a cluster and builds an image."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest

import ray_sandbox.modal as modal
from ray_sandbox.actor import api
from ray_sandbox.runtime import ImageStore
from ray_sandbox.runtime.errors import SandboxError
from tests.compat.conftest import BUILDS
from tests.fx_hostile import heavy
from tests.fx_ray import homes_cluster
from tests.fx_runtime import NODE_IMAGES


@heavy
@pytest.mark.timeout(1200)
def test_a_built_image_starts_sandboxes_on_another_node(tmp_path_factory, default_image,
                                                        build_ca):
    import ray

    homes = [tmp_path_factory.mktemp(f"rsb-dsl-node{i}") for i in range(2)]
    args = [{"resources": {f"node{i}": 1}, "object_store_memory": 150 * 2**20} for i in range(2)]
    image = modal.Image.debian_slim().run_commands("echo built-once > /built")
    with homes_cluster(homes, node_args=args):
        home_of = {n["NodeID"]: homes[int(next(r for r in n["Resources"]
                                               if r.startswith("node") and r[4:].isdigit())[4:])]
                   for n in ray.nodes() if n["Alive"]}
        here = ray.get_runtime_context().get_node_id()
        other = next(n for n in home_of if n != here)
        made = []
        try:
            ref = image.object_id  # the build, on the caller's node
            assert here in ref and str(home_of[here]) in ref
            for node in (other, other, here):
                made.append(sb := api.create(image=ref, node_id=node, cpu=0.2,
                                             memory="128Mi"))
                assert ray.get(sb.exec.remote("cat /built")).stdout == "built-once\n"
            assert [p.name for p in (home_of[other] / "fs-images" / here).iterdir()] == \
                [ref.rsplit("/", 1)[1].split(":")[0]]  # fetched to the other node once
        finally:
            ray.get([s.terminate.remote() for s in made])
            with contextlib.suppress(SandboxError):
                api.delete_filesystem_image(image.object_id)
            digest_prefix = image.object_id.rsplit("/", 1)[1].split(":")[0]
            for record in BUILDS.glob("*/built.json"):
                built = json.loads(record.read_text())
                if built["digest"].removeprefix("sha256:")[:32] == digest_prefix:
                    with contextlib.suppress(SandboxError):
                        ImageStore(NODE_IMAGES).remove(built["digest"])
                    shutil.rmtree(record.parent, ignore_errors=True)
                    record.parent.with_suffix(".lock").unlink(missing_ok=True)
