"""SkyRL's Harbor trials on ray_sandbox.

SkyRL trains on Harbor tasks through its ``HarborGenerator``
(``examples/train_integrations/harbor/`` of github.com/NovaSky-AI/SkyRL), which turns the
mapping ``harbor_trial_config`` into Harbor's ``TrialConfig`` once per trajectory. Harbor
takes a third-party environment by import path, before ``type``
(``harbor/environments/factory.py``), so ray_sandbox's Harbor environment is selected with
one key::

    harbor_trial_config.environment.import_path=ray_sandbox.harbor:RaySandboxEnvironment

One key of SkyRL's ``harbor_trial_config/default.yaml`` must go first:
``environment.kwargs.auto_stop_interval_mins`` is Daytona's, and Harbor hands ``kwargs`` to
the environment's options model, which refuses keys it does not know (ray_sandbox's
``RaySandboxOptions``). SkyRL merges command-line keys into that file and cannot delete one,
so edit the file (or write a copy with :func:`trial_config`). ``override_cpus`` and
``override_memory_mb`` apply as Harbor's resource overrides; ``override_storage_mb`` is the
sandbox's ``disk``. Harbor >= 0.26 is needed (``ray_sandbox[harbor]``), and Ray's version is
ray_sandbox's (docs/integrations.md says what that means next to SkyRL's own pins).

This module has no dependency: it only rewrites the mapping.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

IMPORT_PATH = "ray_sandbox.harbor:RaySandboxEnvironment"
# environment.kwargs keys of other environments that SkyRL's default.yaml sets and
# RaySandboxOptions refuses
FOREIGN_KWARGS = ("auto_stop_interval_mins", "sandbox_timeout_secs")


def trial_config(config: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    """SkyRL's ``harbor_trial_config`` (e.g. its default.yaml, loaded) selecting ray_sandbox:
    ``environment.import_path`` set, other environments' kwargs dropped, ``options`` (the
    Harbor environment's ``--ek`` options: ``network``, ``resources``, ``sandbox``, …) as its
    kwargs. The input is not changed."""
    out = copy.deepcopy(dict(config))
    env = dict(out.get("environment") or {})
    env["import_path"] = IMPORT_PATH
    kwargs = {k: v for k, v in dict(env.get("kwargs") or {}).items() if k not in FOREIGN_KWARGS}
    kwargs.update(options)
    env["kwargs"] = kwargs
    out["environment"] = env
    return out


__all__ = ["FOREIGN_KWARGS", "IMPORT_PATH", "trial_config"]
