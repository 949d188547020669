"""SkyRL's Harbor trial config on ray_sandbox, and one trial the way HarborGenerator runs it.

    pip install -e '.[skyrl]'        # Harbor 0.26 (Python >= 3.12) and Ray
    python examples/skyrl_harbor_trial.py DEFAULT_YAML --write ray_sandbox.yaml [--task TASK]

DEFAULT_YAML is SkyRL's
``examples/train_integrations/harbor/harbor_trial_config/default.yaml``; TASK a Harbor task.

Writes SkyRL's ``harbor_trial_config`` with ``environment.import_path`` set to ray_sandbox's
Harbor environment and the Daytona-only kwarg removed (``integrations.skyrl.trial_config``);
point SkyRL's ``main_harbor`` at the written file. With ``--task``, runs one trial of that
task with Harbor's ``oracle`` agent (no LLM): ``TrialConfig.model_validate`` ->
``Trial.create`` -> ``run``, as ``HarborGenerator`` does per trajectory.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import yaml

from ray_sandbox.integrations.skyrl import trial_config


async def one_trial(config: dict, task: Path) -> None:
    from harbor.models.trial.config import TrialConfig
    from harbor.trial.trial import Trial

    trials = Path(config.get("trials_dir", "trials")).expanduser()  # SkyRL says ~/trials
    config = {**config, "task": {"path": str(task)}, "trials_dir": str(trials),
              "agent": {**config.get("agent", {}), "name": "oracle", "kwargs": {}}}
    result = await (await Trial.create(TrialConfig.model_validate(config))).run()
    print("reward:", result.verifier_result.rewards if result.verifier_result else None,
          "error:", result.exception_info)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("default_yaml", type=Path, help="SkyRL's harbor_trial_config/default.yaml")
    ap.add_argument("--write", type=Path, help="where to write the ray_sandbox config")
    ap.add_argument("--task", type=Path, help="a Harbor task directory to run once")
    args = ap.parse_args()
    text = args.default_yaml.read_text()
    config = trial_config(yaml.safe_load(text) or {})
    if args.write:
        args.write.write_text(yaml.safe_dump(config, sort_keys=False))
        print("wrote", args.write)
    print("environment:", config["environment"])
    if args.task:
        asyncio.run(one_trial(config, args.task))


if __name__ == "__main__":
    main()
