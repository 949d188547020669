"""mypy over ray_sandbox/ against a baseline that only shrinks (run by .ci/run).

runtime/ and client/ are strict (pyproject.toml) and must have no error at all. Every other
file may have at most the errors mypy-baseline.json ({file: count}) lists for it; a file it
does not list, none. When a file has fewer, the baseline should follow:
``python scripts/mypy_check.py --update`` rewrites it, and only ever lowers it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "mypy-baseline.json"
STRICT = ("ray_sandbox/runtime/", "ray_sandbox/client/")
ERROR = re.compile(r"^(ray_sandbox/[^:]+\.py):\d+: error: ")


def run_mypy() -> list[tuple[str, str]]:
    """(file, line) of each error mypy reports; a crash or a usage error (exit 2) ends the
    check."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "ray_sandbox"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    errors = [(m[1], line) for line in proc.stdout.splitlines() if (m := ERROR.match(line))]
    # exit 1 means "errors found": it must come with errors (a missing mypy also exits 1)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not errors):
        sys.exit(f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return errors


def main(update: bool) -> int:
    errors = run_mypy()
    found = Counter(f for f, _ in errors)
    baseline: dict[str, int] = json.loads(BASELINE.read_text())
    over = sorted(f for f, n in found.items() if f.startswith(STRICT) or n > baseline.get(f, 0))
    for f in over:
        allowed = 0 if f.startswith(STRICT) else baseline.get(f, 0)
        print(f"{f}: {found[f]} mypy errors, {allowed} allowed", file=sys.stderr)
        print("\n".join(f"  {line}" for g, line in errors if g == f), file=sys.stderr)
    if over:
        print(f"mypy: {len(over)} file(s) over the baseline (mypy-baseline.json); fix the "
              "errors above (runtime/ and client/ allow none)", file=sys.stderr)
        return 1
    lower = {f: n for f, n in baseline.items() if found.get(f, 0) < n}
    if lower and update:
        BASELINE.write_text(json.dumps(dict(sorted(found.items())), indent=2) + "\n")
        print(f"mypy: baseline lowered for {len(lower)} file(s)")
    elif lower:
        for f, n in sorted(lower.items()):
            print(f"{f}: {found.get(f, 0)} mypy errors, baseline {n}")
        print("mypy: fewer errors than the baseline; lower it: "
              "python scripts/mypy_check.py --update")
    print(f"mypy: {sum(found.values())} errors, none over the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main(update="--update" in sys.argv[1:]))
