"""Pulls that reach only public addresses (``pull_network="public"``): real skopeo against a
real registry behind "public" fronts under the test's control (tests/fx_pulls.py: a namespace
on a veth, sinks on the node's loopback, its own address and a private one). On the node's
network skopeo goes wherever a front points it (the hole); with ``pull_network="public"`` no
sink sees a connection, the pull fails with a typed error, and nothing of the pull's namespace
is left. Names the pull resolves through its own resolver get the same treatment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, network
from ray_sandbox.runtime.config import SandboxConfig
from ray_sandbox.runtime.errors import RegistryUnreachableError, SandboxError
from ray_sandbox.runtime.images import ImageStore
from tests.fx_images import assert_store_clean, scratch_dir
from tests.fx_pulls import IMAGE, NAMES, PUBLIC, SECRET, Side, public_side, pull_dirs
from tests.fx_runtime import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, nft)")


@pytest.fixture(scope="module")
def side(registry: str, pushed_busybox: str) -> Iterator[Side]:
    with public_side(registry) as s:
        yield s


@pytest.fixture
def pull_dns(side: Side, monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolated pulls resolve through the test's resolver on the public side."""
    monkeypatch.setenv("RAY_SANDBOX_NET_PULL_DNS", PUBLIC)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """No namespace, table, helper process or lease of a pull is left (objects of other runs
    that existed before excepted), and no pull directory."""
    before = network.leftovers()
    yield
    left = {k: new for k, v in network.leftovers().items() if (new := set(v) - set(before[k]))}
    assert not left, f"network leftovers: {left}"
    assert pull_dirs() == [], pull_dirs()


@pytest.fixture
def store(side: Side) -> Iterator[ImageStore]:
    with scratch_dir("rsb-pull-store-") as root:
        yield ImageStore(root / "images", insecure_registries=side.registries())


def test_the_realm_reaches_the_nodes_loopback_from_the_nodes_network(side: Side,
                                                                      store: ImageStore):
    """The hole, shown on the node's network: the token service named by the realm is on
    the node's loopback, and what it answered went back to the tenant's registry."""
    n = len(side.hits.at("node"))
    store.get(f"{side.front('realm-loop')}/{IMAGE}")
    assert {h[2].split("?")[0] for h in side.hits.at("node")[n:]} == {"/token"}
    assert f"Bearer {SECRET}" in {h[3] for h in side.hits.at("realm-loop")}


@pytest.mark.parametrize("front", ["realm-loop", "realm-node"])
def test_an_isolated_pull_never_reaches_the_realm_on_the_nodes_side(
        side: Side, store: ImageStore, no_leaks: None, front: str):
    n = len(side.hits.seen)
    with pytest.raises(RegistryUnreachableError) as info:
        store.get(f"{side.front(front)}/{IMAGE}", network="public")
    assert "/token" in info.value.message and "connection refused" in info.value.message
    assert side.hits.at("node") == [h for h in side.hits.seen[:n] if h[0] == "node"]
    assert SECRET not in json.dumps(side.hits.seen[n:])
    assert side.hits.at(front)  # the front itself was reached: the path out works
    assert_store_clean(store)


@pytest.mark.parametrize("front,sink", [("redirect-loop", "node"),
                                        ("redirect-private", "private")])
def test_redirects_to_the_nodes_loopback_or_a_private_address(
        side: Side, store: ImageStore, front: str, sink: str):
    """On the node's network the blobs come from wherever the front sends them; an isolated
    pull is refused there and stores nothing."""
    n = len(side.hits.at(sink))
    store.get(f"{side.front(front)}/{IMAGE}")
    assert any("/blobs/" in h[2] for h in side.hits.at(sink)[n:])
    with scratch_dir("rsb-pull-store-") as root:
        isolated = ImageStore(root / "images", insecure_registries=side.registries())
        n = len(side.hits.at(sink))
        with pytest.raises(RegistryUnreachableError) as info:
            isolated.get(f"{side.front(front)}/{IMAGE}", network="public")
        assert "/blobs/" in info.value.message and "connection refused" in info.value.message
        assert side.hits.at(sink)[n:] == []
        assert_store_clean(isolated)


@pytest.mark.parametrize("name", ["loop.rsbt.test", "node.rsbt.test", "inside.rsbt.test"])
def test_a_name_that_resolves_to_the_nodes_side_reaches_nothing(
        side: Side, store: ImageStore, pull_dns: None, no_leaks: None, name: str):
    """Resolved at pull time (after any check of the reference), inside the namespace: an
    answer on the node's side or a private one opens nothing (DNS rebinding)."""
    port = side.ports["node"] if name != "inside.rsbt.test" else side.ports["private"]
    n = len(side.hits.seen)
    with pytest.raises(RegistryUnreachableError) as info:
        store.get(f"{name}:{port}/{IMAGE}", network="public")
    assert f"{NAMES[name]}:{port}: connect: connection refused" in info.value.message
    assert side.hits.seen[n:] == []


def test_an_isolated_pull_works_by_address_and_by_name(side: Side, store: ImageStore,
                                                       pull_dns: None, no_leaks: None):
    image = store.get(f"{side.front('plain')}/{IMAGE}", network="public")
    by_name = store.get(f"good.rsbt.test:{side.ports['plain']}/{IMAGE}", network="public")
    assert by_name.digest == image.digest
    assert Path(image.rootfs, "bin", "busybox").exists()


def test_an_isolated_pull_uses_no_proxy(side: Side, store: ImageStore, no_leaks: None,
                                        monkeypatch: pytest.MonkeyPatch):
    """A proxy connects for the pull wherever the proxy reaches, and the namespace would see
    only the proxy's address: an isolated pull goes without one."""
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(var, f"http://{side.front('proxy')}")
    ref = f"{side.front('plain')}/{IMAGE}"
    n = len(side.hits.at("proxy"))
    with suppress(SandboxError):
        store.get(ref)  # the node's network: through the proxy
    assert side.hits.at("proxy")[n:]
    with scratch_dir("rsb-pull-store-") as root:
        isolated = ImageStore(root / "images", insecure_registries=side.registries())
        n = len(side.hits.at("proxy"))
        isolated.get(ref, network="public")
        assert side.hits.at("proxy")[n:] == []


def test_a_stored_image_is_not_pulled_again(side: Side, store: ImageStore, no_leaks: None):
    """The cache answers whichever network pulled the image first: an isolated get of an
    image pulled on the node's network starts nothing and asks no registry."""
    ref = f"{side.front('plain')}/{IMAGE}"
    first = store.get(ref)
    n = len(side.hits.seen)
    assert store.get(ref, network="public").digest == first.digest
    assert side.hits.seen[n:] == []
    # another name of the same image is fetched (through the namespace) and finds it stored
    pinned = f"{side.front('plain')}/lab/busybox@{first.digest}"
    assert store.get(pinned, network="public").digest == first.digest
    assert len(store.list()) == 2 and {i.digest for i in store.list()} == {first.digest}


def test_a_sandbox_runs_from_an_isolated_pull(side: Side, tmp_path: Path, no_leaks: None):
    with scratch_dir("rsb-pull-store-") as root:
        images = ImageStore(root / "images", insecure_registries=side.registries())
        rt = SandboxRuntime(tmp_path / "home", images=images)
        try:
            sid = rt.create(SandboxConfig(image=f"{side.front('plain')}/{IMAGE}",
                                          pull_network="public", memory="64Mi", cpu=0.2))
            assert rt.exec(sid, ["echo", "hi"]).stdout == "hi\n"
            rt.delete(sid)
            with pytest.raises(SandboxError):  # and a tenant's realm trick fails the create
                rt.create(SandboxConfig(image=f"{side.front('realm-loop')}/{IMAGE}",
                                        pull_network="public", memory="64Mi"))
        finally:
            rt.close()
            rt.gc()
        assert leftovers(tmp_path / "home", store=images.root) == {}


PULLER = """
import sys
from ray_sandbox.runtime.images import ImageStore
ImageStore(sys.argv[1], insecure_registries=[sys.argv[2]]).get(
    sys.argv[2] + "/lab/x:1", network="public")
"""


def test_a_pull_whose_process_died_is_removed_by_gc(side: Side, tmp_path: Path,
                                                    no_leaks: None):
    """A process killed during an isolated pull leaves its namespace, helpers and skopeo;
    the next gc on the node (here a runtime's) removes them all."""
    before = set(network.leftovers()["netns"])
    hang = f"{PUBLIC}:{side.hang}"
    proc = subprocess.Popen([sys.executable, "-c", PULLER, str(tmp_path / "images"), hang],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pull_dirs() or set(network.leftovers()["netns"]) == before:
            assert proc.poll() is None and time.monotonic() < deadline, "no pull started"
            time.sleep(0.05)
        while not (skopeo := pulling(hang)):
            assert proc.poll() is None and time.monotonic() < deadline, "no skopeo started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pull_dirs() and pulling(hang) == skopeo  # all of it outlived the process
    rt = SandboxRuntime(tmp_path / "home")
    try:
        rt.gc()
    finally:
        rt.close()
    assert pulling(hang) == []


def pulling(registry: str) -> list[int]:
    """PIDs of the skopeo processes pulling from ``registry`` (zombies excepted)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if argv and argv[0].endswith(b"skopeo") and state != "Z" and any(
                registry.encode() in a for a in argv):
            found.append(int(p.name))
    return sorted(found)
