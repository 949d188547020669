"""The README's test command is exactly what CI runs (.ci/run): one command, in two places."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _joined(text: str) -> str:
    return re.sub(r"\s*\\\n\s*", " ", text)


def test_readme_runs_what_ci_runs():
    ci = [line for line in _joined((ROOT / ".ci/run").read_text()).splitlines()
          if line.startswith("bash scripts/setup.sh")]
    readme = _joined((ROOT / "README.md").read_text())
    assert len(ci) == 1
    assert "bin/ruff check" in ci[0] and "scripts/mypy_check.py" in ci[0]
    assert ci[0] in readme.splitlines()
