"""Pure parts of volumes: each volume becomes one bind in the OCI spec, from the sandbox's
own bind of it, read-only where asked; names follow config's one rule."""

from pathlib import Path

import pytest

from ray_sandbox.runtime.bundle import SandboxDir, build_spec
from ray_sandbox.runtime.config import make_config
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.volumes import _check_name

SID = "0123456789abcdef0123456789abcdef"


def test_each_volume_is_a_bind_of_the_sandboxs_own_mount():
    sdir = SandboxDir(Path("/state") / SID)
    cfg = make_config(volumes={"/ws": "work", "/data/cache": "cache:ro"})
    spec = build_spec(sandbox_id=SID, config=cfg, rootfs=Path("/r"), image_env=[], sdir=sdir,
                      agent_dir=Path("/opt/agent"))
    binds = {m.destination: (m.source, m.options) for m in spec.mounts}
    assert binds["/ws"] == (f"/state/{SID}/volumes/0", ["rbind", "rw"])
    assert binds["/data/cache"] == (f"/state/{SID}/volumes/1", ["rbind", "ro"])
    assert [(name, ro) for _, name, ro, _ in sdir.volume_binds(cfg)] == [("work", False),
                                                                          ("cache", True)]
    # volumes come after /tmp, so one under /tmp lands on top of it
    order = [m.destination for m in spec.mounts]
    assert order.index("/ws") > order.index("/tmp")


def test_no_volumes_no_binds():
    sdir = SandboxDir(Path("/state") / SID)
    assert sdir.volume_binds(make_config()) == []


@pytest.mark.parametrize("bad", ["", "Upper", "a/b", "..", "-x", "x" * 64])
def test_names_follow_the_config_rule(bad):
    with pytest.raises(ConfigError):
        _check_name(bad)


def test_good_name():
    _check_name("rollout-17.ws_2")
