"""The OCI spec builder and the spec-transform hook."""

import json
from pathlib import Path

import pytest

from ray_sandbox.runtime.bundle import SandboxDir, build_spec, merge_env
from ray_sandbox.runtime.config import make_config, node_pids_limit
from ray_sandbox.runtime.errors import SandboxCreationError
from ray_sandbox.runtime.spec import Spec, apply_transform

SID = "0123456789abcdef0123456789abcdef"


def _spec(**cfg) -> Spec:
    return build_spec(
        sandbox_id=SID,
        config=make_config(**cfg),
        rootfs=Path("/images/rootfs"),
        image_env=["PATH=/bin", "LANG=C.UTF-8"],
        sdir=SandboxDir(Path("/state") / SID),
        agent_dir=Path("/opt/agent"),
    )


def test_limits_and_agent_as_pid1():
    spec = _spec(cpu=0.5, memory="256Mi")
    data = json.loads(spec.to_json())
    assert data["linux"]["resources"]["memory"]["limit"] == 256 * 2**20
    # the boot limit: one core at least (bundle.boot_cpu); the share comes after the boot
    assert data["linux"]["resources"]["cpu"] == {"quota": 500000, "period": 500000}
    assert data["process"]["args"][0] == "/.rsb/bin/rsb-agent"
    assert data["process"]["terminal"] is False
    assert data["root"] == {"path": "/images/rootfs", "readonly": True}
    dests = {m["destination"]: m for m in data["mounts"]}
    assert dests["/.rsb/bin"]["options"] == ["rbind", "ro"]
    assert dests["/.rsb/run"]["source"] == f"/state/{SID}/run"
    assert dests["/tmp"]["type"] == "tmpfs"


def test_readonly_workdir_gets_its_own_writable_mount():
    data = json.loads(_spec(workdir="/app").to_json())
    work = [m for m in data["mounts"] if m["destination"] == "/app"]
    assert work and work[0]["source"] == f"/state/{SID}/work" and "rw" in work[0]["options"]
    data = json.loads(_spec(workdir="/app", readonly=False).to_json())
    assert not [m for m in data["mounts"] if m["destination"] == "/app"]
    assert data["root"]["readonly"] is False


def test_capabilities_none_and_default():
    caps = json.loads(_spec(capabilities=[]).to_json())["process"]["capabilities"]
    assert caps["bounding"] == [] and caps["effective"] == []
    caps = json.loads(_spec().to_json())["process"]["capabilities"]
    assert "CAP_CHOWN" in caps["bounding"] and "CAP_SYS_ADMIN" not in caps["bounding"]


def test_no_cap_mknod_adds_a_seccomp_filter_against_device_nodes():
    for caps in (None, ["CAP_MKNOD"]):
        assert "seccomp" not in json.loads(_spec(capabilities=caps).to_json())["linux"]
    seccomp = json.loads(_spec(capabilities=["CAP_CHOWN"]).to_json())["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ALLOW"
    rules = {(r["names"][0], r["args"][0]["index"], r["args"][0]["valueTwo"]): r
             for r in seccomp["syscalls"]}
    assert set(rules) == {("mknod", 1, 0o020000), ("mknod", 1, 0o060000),
                          ("mknodat", 2, 0o020000), ("mknodat", 2, 0o060000)}
    for r in rules.values():
        assert r["action"] == "SCMP_ACT_ERRNO" and r["errnoRet"] == 1  # EPERM
        assert r["args"] == [{**r["args"][0], "op": "SCMP_CMP_MASKED_EQ", "value": 0o170000}]


def test_unlimited_resources_are_omitted_and_pids_bounded_by_default():
    data = json.loads(_spec(cpu=None, memory=None, pids_limit=None).to_json())
    assert data["linux"]["resources"] == {}
    data = json.loads(_spec().to_json())
    assert data["linux"]["resources"]["pids"] == {"limit": node_pids_limit()}


def test_merge_env_overrides_and_defaults_path():
    assert merge_env(["A=1", "B=2"], {"B": "3"}) == [
        "A=1", "B=3", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    ]
    assert merge_env(["PATH=/x", "E=a=b"], {}) == ["PATH=/x", "E=a=b"]


def test_transform_mutating_in_place():
    def harden(spec):
        spec["process"]["rlimits"] = [{"type": "RLIMIT_NPROC", "hard": 64, "soft": 64}]
        for cap_type in spec["process"]["capabilities"]:
            spec["process"]["capabilities"][cap_type] = []

    out = apply_transform(_spec(), harden, sandbox_id=SID)
    assert out.process.rlimits[0].type == "RLIMIT_NPROC"
    assert out.process.capabilities.bounding == []


def test_transform_returning_new_dict_keeps_unknown_fields():
    def hook(spec):
        new = dict(spec)
        new["annotations"] = {"x": "y"}
        new["linux"] = {**spec["linux"], "seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}
        return new

    out = json.loads(apply_transform(_spec(), hook, sandbox_id=SID).to_json())
    assert out["annotations"] == {"x": "y"}
    assert out["linux"]["seccomp"] == {"defaultAction": "SCMP_ACT_ALLOW"}


@pytest.mark.parametrize(
    "hook",
    [
        lambda s: 42,
        lambda s: {"process": {}},
        lambda s: 1 / 0,
        lambda s: {**s, "process": {**s["process"], "args": []}},
        lambda s: {**s, "process": {**s["process"], "user": {"uid": -1}}},
    ],
)
def test_bad_transforms_are_creation_errors(hook):
    with pytest.raises(SandboxCreationError) as info:
        apply_transform(_spec(), hook, sandbox_id=SID)
    assert info.value.sandbox_id == SID


def test_transform_does_not_touch_the_original():
    spec = _spec()
    before = spec.to_json()
    apply_transform(spec, lambda s: s["process"].update(cwd="/x"), sandbox_id=SID)
    assert spec.to_json() == before


def test_public_network_gets_an_identity_mapped_user_namespace():
    def linux(**net) -> dict:
        spec = build_spec(
            sandbox_id=SID, config=make_config(), rootfs=Path("/images/rootfs"),
            image_env=[], sdir=SandboxDir(Path("/state") / SID), agent_dir=Path("/opt/agent"),
            **net,
        )  # fmt: skip
        return json.loads(spec.to_json())["linux"]

    public = linux(netns_path="/run/netns/rsb-x", host_network=True)
    assert {"type": "user"} in public["namespaces"]
    identity = [{"containerID": 0, "hostID": 0, "size": 2**32 - 1}]
    assert public["uidMappings"] == public["gidMappings"] == identity
    # "host" (the node's netns) and the other modes: no user namespace in the spec.
    for net in ({"host_network": True}, {"netns_path": "/run/netns/rsb-x"}, {}):
        other = linux(**net)
        assert all(ns["type"] != "user" for ns in other["namespaces"]), net
        assert "uidMappings" not in other and "gidMappings" not in other, net


def test_docker_adds_gvisors_cgroupfs_and_a_storage_tmpfs_sized_by_disk():
    data = json.loads(_spec(docker=True, readonly=False, memory="1Gi", disk="2Gi").to_json())
    dests = {m["destination"]: m for m in data["mounts"]}
    assert dests["/sys/fs/cgroup"]["type"] == "cgroup"
    assert dests["/var/lib/docker"]["type"] == "tmpfs"
    assert f"size={2 * 2**30}" in dests["/var/lib/docker"]["options"]
    assert "CAP_SYS_ADMIN" in data["process"]["capabilities"]["bounding"]
    no_disk = json.loads(_spec(docker=True, readonly=False, memory="1Gi").to_json())
    storage = [m for m in no_disk["mounts"] if m["destination"] == "/var/lib/docker"]
    assert f"size={2**30}" in storage[0]["options"]  # memory= bounds it without disk=
    plain = json.loads(_spec(readonly=False).to_json())
    assert not {"/sys/fs/cgroup", "/var/lib/docker"} & {m["destination"] for m in plain["mounts"]}
