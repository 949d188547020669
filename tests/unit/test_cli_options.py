"""``--opt KEY=VALUE`` of ``ray-sandbox run``/``create``/``mcp serve``: every SandboxConfig
field, validated by SandboxConfig; an unknown or doubly given option names itself."""

import pytest

from ray_sandbox.cli._options import KEYS, parse_opts, sandbox_config
from ray_sandbox.runtime.config import SandboxConfig
from ray_sandbox.runtime.errors import ConfigError


def test_every_field_but_the_callable_is_a_key():
    assert set(KEYS) == set(SandboxConfig.model_fields) - {"spec_transform"}


def test_values_become_the_fields_types():
    cfg = sandbox_config([
        "pids_limit=256", "directfs=false", "cpu=0.5", "memory=1Gi", "user=1000",
        "ttl-seconds=60", "network=public", 'dns=["1.1.1.1"]', "expose_ports=[8080]",
        'egress={"default": "deny"}', 'env={"A": "b=c"}', "capabilities=[]", "disk=null",
    ])
    assert (cfg.pids_limit, cfg.directfs, cfg.cpu, cfg.memory, cfg.user, cfg.ttl_seconds) == (
        256, False, 0.5, 2**30, "1000", 60.0)
    assert (cfg.dns, cfg.expose_ports, cfg.egress.default, cfg.env, cfg.capabilities) == (
        ("1.1.1.1",), (8080,), "deny", {"A": "b=c"}, ())
    assert cfg.disk is None


def test_flags_and_opts_apply_over_the_base():
    base = {"image": "ray-sandbox/busybox", "readonly": False, "memory": "64Mi"}
    cfg = sandbox_config(["pids_limit=300"], base, memory="128Mi", cpu=None)
    assert (cfg.image, cfg.readonly, cfg.memory, cfg.cpu, cfg.pids_limit) == (
        "ray-sandbox/busybox", False, 128 * 2**20, 1.0, 300)


@pytest.mark.parametrize(("opts", "flags", "named"), [
    (["nope=1"], {}, "unknown sandbox option 'nope'"),
    (["spec_transform=x"], {}, "unknown sandbox option 'spec_transform'"),
    (["pids_limit"], {}, "--opt needs KEY=VALUE, got 'pids_limit'"),
    (["=1"], {}, "--opt needs KEY=VALUE"),
    (["pids_limit=256", "pids-limit=512"], {}, "'pids_limit' is given twice"),
    (["memory=1Gi"], {"memory": "2Gi"}, "memory set both by a flag and by --opt"),
    (["dns=[1.1.1.1"], {}, "'dns': '[1.1.1.1' is not JSON"),
    (["pids_limit=12"], {}, "pids_limit: "),
    (["directfs=maybe"], {}, "directfs: "),
])
def test_bad_options_name_themselves(opts, flags, named):
    with pytest.raises(ConfigError) as exc:
        sandbox_config(opts, **flags)
    assert named in str(exc.value)


def test_parse_keeps_scalars_as_text():
    assert parse_opts(["image=busybox", "workdir=/w", "labels={}"]) == {
        "image": "busybox", "workdir": "/w", "labels": {}}
