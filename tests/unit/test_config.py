"""SandboxConfig validation: bad values and impossible combinations fail before any work."""

from pathlib import Path

import pytest

from ray_sandbox.runtime.config import (
    DOCKER_DEFAULT_CAPABILITIES,
    EgressPolicy,
    SandboxConfig,
    make_config,
    parse_size,
)
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.runsc import Runsc, RunscFlags, RunscVersion


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512Mi", 512 * 2**20), ("1Gi", 2**30), ("100M", 10**8), (4096, 4096), ("1.5Gi", 3 * 2**29)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "12x", "-1", "Mi", 0, True])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory": "lots"}, "memory"),
        ({"memory": "1Mi"}, "memory"),
        ({"cpu": -1}, "cpu"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"env": {"A": "x\0y"}}, "env"),
        ({"workdir": "relative"}, "workdir"),
        ({"workdir": "/proc/x"}, "workdir"),
        ({"capabilities": ["CAP_NOPE"]}, "capabilities"),
        ({"capabilities": "CAP_CHOWN"}, "capabilities"),
        ({"network": "wifi"}, "network"),
        ({"dns": ["not-an-ip"], "network": "public"}, "dns"),
        ({"expose_ports": [0], "network": "public"}, "expose_ports"),
        ({"ttl_seconds": -1}, "ttl_seconds"),
        ({"user": "a b"}, "user"),
        ({"image": " spaced"}, "image"),
        ({"bogus": 1}, "bogus"),
        ({"disk": "lots"}, "disk"),
        ({"disk": 0}, "disk"),
        ({"disk": "1M"}, "disk"),  # 10**6 bytes: below the 1 MiB floor
        ({"disk": "512Ki"}, "disk"),
        ({"disk": 2**20 - 1}, "disk"),
        ({"directfs": "sometimes"}, "directfs"),
    ],
)
def test_field_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        make_config(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dns": ["1.1.1.1"]},  # network none has no resolver
        {"network": "host", "dns": ["1.1.1.1"]},
        {"egress": EgressPolicy()},
        {"expose_ports": [8080]},
        {"network": "sandbox", "rootless": True},
        {"disk": "1Gi", "rootless": True},  # a loop mount needs root
    ],
)
def test_impossible_combinations(kwargs):
    with pytest.raises(ConfigError):
        make_config(**kwargs)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("16Mi", 16 * 2**20), ("1Gi", 2**30), ("2G", 2 * 10**9), (2**20, 2**20), ("1Mi", 2**20),
     ("1.5Gi", 3 * 2**29), (None, None)],
)
def test_disk_sizes_parse_like_memory(value, expected):
    assert make_config(disk=value).disk == expected


def test_spec_transform_alias_and_override_keeps_hook():
    def hook(spec):
        return spec

    cfg = make_config(_oci_spec_transform_fn=hook, memory="1Gi")
    assert cfg.spec_transform is hook and cfg.memory == 2**30
    again = make_config(cfg, cpu=2)
    assert again.spec_transform is hook and again.cpu == 2 and again.memory == 2**30


def test_capability_names_normalized_and_default_set():
    assert make_config(capabilities=["chown", "CAP_KILL"]).capabilities == ("CAP_CHOWN", "CAP_KILL")
    assert make_config().effective_capabilities == DOCKER_DEFAULT_CAPABILITIES
    assert make_config(capabilities=[]).effective_capabilities == ()


def test_egress_policy_validates():
    p = EgressPolicy(allow_cidrs=["10.1.2.3/8"], allow_domains=["Example.COM."])
    assert p.allow_cidrs == ("10.0.0.0/8",) and p.allow_domains == ("example.com",)
    for bad in ({"allow_cidrs": ["10.0.0.0/33"]}, {"allow_domains": ["no spaces.com"]}):
        with pytest.raises(ValueError):
            EgressPolicy(**bad)


def test_config_is_immutable():
    cfg = SandboxConfig()
    with pytest.raises(ValueError):
        cfg.cpu = 3  # type: ignore[misc]


def _runsc(date: int) -> Runsc:
    r = Runsc(Path("/state/runsc"), binary="runsc")
    r.__dict__["version"] = RunscVersion(version=f"0.0~{date}.0", date=date)  # no binary run
    return r


def test_directfs_defaults_on_and_reaches_runsc_argv_only_when_off():
    assert make_config().directfs is True and make_config(directfs=False).directfs is False
    base = RunscFlags(network="none", overlay="none", platform="ptrace")
    hard = base.model_copy(update={"directfs": False, "oci_seccomp": True})
    new = _runsc(20240729)
    assert "--directfs=false" not in new._argv("run", "ID", flags=base)
    hardened = new._argv("run", "ID", flags=hard)
    assert hardened[-2:] == ["run", "ID"]  # global flags precede the verb
    assert {"--directfs=false", "--oci-seccomp"} <= set(hardened[:-2])
    # 20221219 has no --directfs (rejects the flag); its sentry never uses directfs.
    assert "--directfs=false" not in _runsc(20221219)._argv("run", "ID", flags=hard)
    # verbs on a running sandbox carry none of a sandbox's own flags
    assert new._argv("state", "ID") == [new.binary, "--root=/state/runsc", "state", "ID"]


def test_auto_pids_limit_is_half_the_pid_space_over_the_planned_density():
    from ray_sandbox.runtime.config import auto_pids_limit

    assert auto_pids_limit(32768, 32) == 1024  # never below what ~110 processes need
    assert auto_pids_limit(4194304, 32) == 4096  # nor above the old fixed default
    assert auto_pids_limit(4194304, 1000) == 2097


def test_cpu_zero_means_unlimited_like_rays_num_cpus_zero():
    assert make_config(cpu=0).cpu is None


def test_an_unknown_option_is_named_as_unknown():
    with pytest.raises(ConfigError, match="nope: unknown option"):
        make_config(image="x", nope=1)


def test_boot_key_ignores_what_a_stocked_sandbox_takes_on_when_handed_out():
    from ray_sandbox.runtime.config import boot_key

    base = SandboxConfig(image="ray-sandbox/busybox", memory="32Mi", readonly=False)
    personal = base.model_copy(update={"env": {"A": "1"}, "labels": {"k": "v"},
                                       "ttl_seconds": 5.0, "user": "1000",
                                       "workdir": "/w", "timeout_seconds": 9.0})
    assert boot_key(base) == boot_key(personal) is not None
    for change in ({"memory": 64 << 20}, {"cpu": 0.5}, {"image": "other"},
                   {"network": "host"}, {"disk": 1 << 30}, {"readonly": True}):
        assert boot_key(base.model_copy(update=change)) != boot_key(base), change


def test_boot_key_is_none_where_no_booted_sandbox_can_serve():
    from ray_sandbox.runtime.config import boot_key

    assert boot_key(SandboxConfig(spec_transform=lambda s: s)) is None
    assert boot_key(SandboxConfig(readonly=True, workdir="/w")) is None


def test_docker_gets_its_capabilities_and_refuses_what_cannot_work():
    from ray_sandbox.runtime.config import DOCKER_IN_SANDBOX_CAPABILITIES

    cfg = make_config(docker=True, readonly=False)
    assert cfg.effective_capabilities == DOCKER_IN_SANDBOX_CAPABILITIES
    assert {"CAP_SYS_ADMIN", "CAP_NET_ADMIN"} <= set(cfg.effective_capabilities)
    assert "CAP_SYS_ADMIN" not in make_config(readonly=False).effective_capabilities
    for kwargs, why in (({}, "readonly=False"),
                        ({"readonly": False, "network": "host"}, "network='host'"),
                        ({"readonly": False, "memory": "64Mi"}, "256Mi"),
                        ({"readonly": False, "capabilities": DOCKER_DEFAULT_CAPABILITIES},
                         "CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_SYS_PTRACE")):
        with pytest.raises(ConfigError, match=why):
            make_config(docker=True, **kwargs)
    # every capability it needs, given explicitly, and unlimited memory are fine
    make_config(docker=True, readonly=False, memory=None,
                capabilities=DOCKER_IN_SANDBOX_CAPABILITIES)
