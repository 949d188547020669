"""Tiny benchmark harness: time a callable, summarize, print a table, save JSON.

Every benchmark module builds rows with :func:`measure` (ours and the baseline side by side, in
the same run) and hands them to :func:`emit`, which prints a rich table and writes
``benchmarks/out/<name>.json``.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_sandbox.runtime.runsc import RunscFlags

OUT = Path(__file__).resolve().parent / "out"

# The baseline sandboxes: plain `runsc run`, no network, no overlay, ptrace.
BARE_RUNSC = RunscFlags(network="none", overlay="none", platform="ptrace")


def measure(label: str, fn: Callable[[], Any], n: int, *, warmup: int = 1, **extra: Any) -> dict:
    """Run ``fn`` ``warmup`` + ``n`` times and return a row with p50/p90/p99/mean in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return summarize(label, samples, **extra)


def summarize(label: str, samples_ms: list[float], **extra: Any) -> dict:
    s = sorted(samples_ms)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {
        "label": label,
        "n": len(s),
        "p50_ms": round(pct(0.50), 3),
        "p90_ms": round(pct(0.90), 3),
        "p99_ms": round(pct(0.99), 3),
        "mean_ms": round(statistics.fmean(s), 3),
        **extra,
    }


def machine() -> dict:
    runsc = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "runsc": runsc.splitlines()[0] if runsc else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def emit(name: str, rows: list[dict], *, notes: str = "") -> Path:
    """Print ``rows`` as a table and save them (with machine facts) to out/<name>.json."""
    from rich.console import Console
    from rich.table import Table

    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    table = Table(title=name)
    for c in cols:
        table.add_column(c, justify="left" if c == "label" else "right")
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in cols))
    Console().print(table)
    if notes:
        print(notes)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), "rows": rows,
                                "notes": notes}, indent=2))
    print(f"saved {path}")
    return path
