"""Volumes through Ray on a two-node cluster whose nodes keep separate homes: a volume is
made on the node asked for, and sandboxes that mount it are placed there (read-write, then
read-only), whichever node the caller is on; delete waits for its users to be gone; an idle
volume is copied and moved to the other node, and its sandboxes follow."""

from __future__ import annotations

import time

import pytest

from ray_sandbox.actor import api
from ray_sandbox.actor.volumes import (
    copy_volume,
    create_volume,
    delete_volume,
    fill_volume,
    inspect_volume,
    list_volumes,
    move_volume,
    volume_node,
)
from ray_sandbox.runtime.errors import (
    ConfigError,
    VolumeExistsError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from tests.fx_hostile import heavy
from tests.fx_ray import homes_cluster


def _idle(name: str, timeout: float = 60.0) -> bool:
    """The volume's users are gone (a terminated sandbox's teardown runs in the background)."""
    deadline = time.monotonic() + timeout
    while inspect_volume(name).mounts and time.monotonic() < deadline:
        time.sleep(0.1)
    return not inspect_volume(name).mounts


@heavy  # 11 s in CI
def test_sandboxes_go_to_their_volumes_node(tmp_path_factory, default_image, busybox_image):
    import ray

    homes = [tmp_path_factory.mktemp(f"rsb-vnode{i}") for i in range(2)]
    args = [{"resources": {f"vnode{i}": 1}} for i in range(2)]
    with homes_cluster(homes, node_args=args):
        by_res = {next(r for r in n["Resources"] if r.startswith("vnode")): n["NodeID"]
                  for n in ray.nodes() if n["Alive"]}
        far = by_res["vnode1"]  # the driver runs on the first node
        info = create_volume("ray-ws", "16Mi", node_id=far)
        assert info.node == far and (homes[1] / "volumes" / "ray-ws" / "volume.img").is_file()
        assert not (homes[0] / "volumes" / "ray-ws").exists()
        assert [(v.name, v.node) for v in list_volumes()] == [("ray-ws", far)]
        with pytest.raises(VolumeExistsError, match="already exists"):
            create_volume("ray-ws", "16Mi", node_id=by_res["vnode0"])
        with pytest.raises(VolumeNotFoundError):
            volume_node(["no-such-volume"])

        # filled from the driver's node: through the object store, unpacked on the far one
        src = homes[0].parent / "fill-src"
        (src / "seed").mkdir(parents=True)
        (src / "seed" / "s.txt").write_text("seeded")
        fill_volume("ray-ws", src, path="/pre")
        sb = api.create(image="ray-sandbox/busybox", memory="64Mi", volumes={"/ws": "ray-ws"})
        assert sb.node_id == far
        assert ray.get(sb.exec.remote("cat /ws/pre/seed/s.txt")).stdout == "seeded"
        assert ray.get(sb.exec.remote("echo across > /ws/f")).exit_code == 0
        assert [u.readonly for u in inspect_volume("ray-ws").mounts] == [False]
        with pytest.raises(VolumeInUseError, match="mounted by"):
            delete_volume("ray-ws")
        # suspended, then resumed with the default placement ("any"): back on the volume's
        # node, not wherever Ray has room; another node named explicitly is refused. A
        # suspended sandbox keeps its volume bound (it comes back with it in place)
        ray.get(sb.suspend.remote())
        assert [u.readonly for u in inspect_volume("ray-ws").mounts] == [False]
        with pytest.raises(ConfigError, match="cannot run on node"):
            api.resume(sb.sandbox_id, placement=by_res["vnode0"])
        sb = api.resume(sb.sandbox_id)
        assert sb.node_id == far
        assert ray.get(sb.exec.remote("cat /ws/f")).stdout == "across\n"
        ray.get(sb.terminate.remote())
        assert _idle("ray-ws")

        readers = api.create_many(2, image="ray-sandbox/busybox", memory="64Mi",
                                  volumes={"/ws": "ray-ws:ro"})
        assert {r.node_id for r in readers} == {far}
        assert [ray.get(r.read_file.remote("/ws/f")) for r in readers] == [b"across\n"] * 2
        ray.get([r.terminate.remote() for r in readers])
        assert _idle("ray-ws")

        # copied, then moved, to the driver's node through the object store
        near = by_res["vnode0"]
        assert copy_volume("ray-ws", near, "ray-ws-copy").node == near
        assert move_volume("ray-ws", near).node == near
        assert sorted((v.name, v.node) for v in list_volumes()) == [("ray-ws", near),
                                                                     ("ray-ws-copy", near)]
        assert not (homes[1] / "volumes" / "ray-ws").exists()
        sb = api.create(image="ray-sandbox/busybox", memory="64Mi",
                        volumes={"/a": "ray-ws:ro", "/b": "ray-ws-copy:ro"})
        assert sb.node_id == near
        assert ray.get(sb.exec.remote("cat /a/f /b/f")).stdout == "across\nacross\n"
        ray.get(sb.terminate.remote())
        assert _idle("ray-ws") and _idle("ray-ws-copy")
        delete_volume("ray-ws")
        delete_volume("ray-ws-copy")
        assert list_volumes() == []
