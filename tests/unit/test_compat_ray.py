"""Ray compatibility, the pure parts (issue 18): actor options onto create(), ids in both
forms, Ray's error names over our tree, ``shell`` and ``memory=0`` in the config,
``duration_ms``. Written from Ray's public sandbox API (``ray.experimental.sandbox``)."""

from __future__ import annotations

import pytest
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray_sandbox
from ray_sandbox.actor.sandbox_class import create_options
from ray_sandbox.runtime import errors
from ray_sandbox.runtime.config import SandboxConfig, boot_key, make_config
from ray_sandbox.runtime.errors import ConfigError, SandboxNotFoundError
from ray_sandbox.runtime.records import parse_id, ray_id
from ray_sandbox.runtime.results import ExecResult, SandboxState, SandboxStatus

HEX = "ab" * 16


def test_actor_options_map_onto_create():
    assert create_options({"num_cpus": 2, "memory": 2 * 2**30, "resources": {"x": 1},
                           "name": "n", "namespace": "ns", "lifetime": "detached",
                           "get_if_exists": True, "max_concurrency": 8, "num_gpus": 0},
                          {"workdir": "/w"}) == {
        "workdir": "/w", "cpu": 2, "memory": 2 * 2**30, "resources": {"x": 1}, "name": "n",
        "namespace": "ns", "lifetime": "detached", "get_if_exists": True}
    # the same value both ways is fine; the sandbox reserves what it may use
    assert create_options({"num_cpus": 1, "memory": 2**29}, {"cpu": 1, "memory": "512Mi"}) \
        == {"cpu": 1, "memory": "512Mi"}
    with pytest.raises(ConfigError, match="num_cpus"):
        create_options({"num_cpus": 2}, {"cpu": 1})


def test_node_affinity_pins_and_other_strategies_are_refused():
    node = "cd" * 28
    assert create_options({"scheduling_strategy": NodeAffinitySchedulingStrategy(
        node, soft=False)}, {}) == {"node_id": node}
    with pytest.raises(NotImplementedError, match="scheduling_strategy"):
        create_options({"scheduling_strategy": "SPREAD"}, {})
    with pytest.raises(NotImplementedError, match="scheduling_strategy"):
        create_options({"scheduling_strategy": NodeAffinitySchedulingStrategy(
            node, soft=True)}, {})


@pytest.mark.parametrize("option", ["max_restarts", "runtime_env", "max_task_retries"])
def test_actor_options_without_a_meaning_are_refused_by_name(option):
    with pytest.raises(NotImplementedError, match=option):
        create_options({option: 1}, {})


def test_gpus_are_refused():
    with pytest.raises(NotImplementedError, match="num_gpus"):
        create_options({"num_gpus": 1}, {})


def test_ids_in_both_forms():
    assert parse_id(HEX) == HEX
    assert parse_id("ray-sandbox-" + HEX) == HEX
    assert ray_id(HEX) == ray_id("ray-sandbox-" + HEX) == "ray-sandbox-" + HEX
    for bad in ("ray-sandbox-xyz", "ray-sb-" + HEX, HEX[:12], None, 7):
        with pytest.raises(SandboxNotFoundError):
            parse_id(bad)


def test_shell_is_a_config_field_that_does_not_change_the_boot():
    cfg = make_config(shell="/bin/bash")
    assert cfg.shell == "/bin/bash" and SandboxConfig().shell is None
    assert boot_key(cfg) == boot_key(SandboxConfig())  # a stocked sandbox can serve it
    for bad in ("bash", "/bin/ba sh", ""):
        with pytest.raises(ConfigError, match="shell"):
            make_config(shell=bad)


def test_memory_zero_means_no_limit_as_in_ray():
    assert make_config(memory=0).memory is None
    assert make_config(cpu=0.0).cpu is None
    with pytest.raises(ConfigError, match="memory"):
        make_config(memory=False)


def test_duration_ms_and_ray_names_of_results():
    assert ExecResult(exit_code=0, duration_seconds=0.25).duration_ms == 250.0
    assert ray_sandbox.ExecutionResult is ExecResult


def test_status_compares_equal_to_its_state_as_rays_enum_does():
    status = SandboxStatus(sandbox_id=HEX, state=SandboxState.RUNNING)
    assert status == SandboxStatus.RUNNING and status != SandboxStatus.TERMINATED
    assert status == SandboxStatus(sandbox_id=HEX, state="RUNNING")
    assert status != SandboxStatus(sandbox_id=HEX, state="PAUSED")
    assert len({status, SandboxStatus(sandbox_id=HEX, state="RUNNING")}) == 1
    assert [s.value for s in SandboxState] == [
        getattr(SandboxStatus, s.value).value for s in SandboxState]


# Ray's error names, and which of them catch each of our errors (Ray's tree: SandboxError
# > SandboxCreationError, SandboxTimeoutError, SandboxExecError, SandboxNotFoundError).
RAY_NAMES = ("SandboxError", "SandboxCreationError", "SandboxTimeoutError",
             "SandboxExecError", "SandboxNotFoundError")
CREATION = {"SandboxError", "SandboxCreationError"}
CAUGHT_BY = {
    "SandboxError": {"SandboxError"},
    "ConfigError": {"SandboxError"},
    "ToolMissingError": {"SandboxError"},
    "CommandError": {"SandboxError"},
    "CommandTimeoutError": {"SandboxError", "SandboxTimeoutError"},
    "ImageError": {"SandboxError"},
    # an image a create could not get is a creation failure, as in Ray
    "ImageReferenceError": CREATION,
    "ImageNotFoundError": CREATION,
    "RegistryUnreachableError": CREATION,
    "RegistryAuthError": CREATION,
    "PlatformNotFoundError": CREATION,
    "ImageCorruptError": CREATION,
    "StoreFullError": CREATION,
    "ImageInUseError": {"SandboxError"},
    "ImageBusyError": {"SandboxError", "SandboxTimeoutError"},
    "SandboxCreationError": CREATION,
    "CapacityError": CREATION,
    "BatchCreateError": CREATION,
    "SandboxNotFoundError": {"SandboxError", "SandboxNotFoundError"},
    "SnapshotNotFoundError": {"SandboxError", "SandboxNotFoundError"},
    "SandboxStateError": {"SandboxError"},
    "HostRetiringError": {"SandboxError"},
    "ResumeError": {"SandboxError"},
    "ImageBuildError": {"SandboxError"},
    "VolumeExistsError": {"SandboxError"},
    "SandboxExistsError": {"SandboxError"},
    "VolumeNotFoundError": {"SandboxError", "SandboxNotFoundError"},
    "VolumeInUseError": {"SandboxError"},
    "SandboxDiedError": {"SandboxError"},
    "AgentTimeoutError": {"SandboxError", "SandboxTimeoutError"},
    "AgentProtocolError": {"SandboxError"},
    "SnapshotCorruptError": {"SandboxError"},
    "ExecError": {"SandboxError", "SandboxExecError"},
    "SandboxFileError": {"SandboxError"},
    "SandboxFileNotFoundError": {"SandboxError"},
    "SandboxIsADirectoryError": {"SandboxError"},
    "SandboxNotADirectoryError": {"SandboxError"},
    "SandboxFileExistsError": {"SandboxError"},
    "SandboxPermissionError": {"SandboxError"},
    "UnsafePathError": {"SandboxError"},
    "FileTooLargeError": {"SandboxError"},
    "NetworkError": {"SandboxError"},
    "SessionError": {"SandboxError"},
    "SandboxExecError": {"SandboxError", "SandboxExecError"},
    "SandboxTimeoutError": {"SandboxError", "SandboxTimeoutError"},
}


def test_every_error_class_is_caught_by_the_ray_names_it_should_be():
    assert set(CAUGHT_BY) == set(errors.__all__)  # a new class needs its row here
    for name, expected in CAUGHT_BY.items():
        err = getattr(ray_sandbox, name)("boom", sandbox_id=HEX)
        caught = set()
        for ray_name in RAY_NAMES:
            try:
                raise err
            except getattr(ray_sandbox, ray_name):
                caught.add(ray_name)
            except Exception:  # noqa: BLE001, S110 - not caught by this one: that is the test
                pass
        assert caught == expected, name


def test_timeouts_that_were_timeout_errors_still_are():
    for cls in (errors.AgentTimeoutError, errors.ImageBusyError):
        assert issubclass(cls, TimeoutError)
    # a killed tool is not an OSError: ``except OSError`` around a tool call keeps it
    assert not issubclass(errors.CommandTimeoutError, OSError)
    assert str(errors.AgentTimeoutError("late", sandbox_id=HEX)) == f"late | sandbox={HEX}"
