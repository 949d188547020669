"""benchmarks/bench_service.py runs end to end (one rep, its own Ray cluster and service,
results not saved): a smoke test, not a measurement (benchmarks measure speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fx_hostile import heavy

ROOT = Path(__file__).resolve().parents[1]


@heavy  # 50 s: two Ray clusters and services (one with direct ingress)
def test_bench_service_runs_with_one_rep():
    code = "import json; from benchmarks.bench_service import run; print(json.dumps(run(1, True)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["label"] for r in rows] == [
        "create→first exec, HTTP", "create→first exec, Ray handle (baseline)",
        "exec round trip, HTTP (POST, then long-poll GET)",
        "exec round trip, HTTP (one POST that waits)", "exec round trip, Ray handle (baseline)",
        "first streamed byte, HTTP", "GET /health, HTTP (Serve's floor)",
        "exec round trip, HTTP direct ingress (one POST that waits)",
        "GET /health, HTTP direct ingress", "exec round trip, Ray handle (baseline, again)"]
    assert all(r["n"] >= 1 and r["p50_ms"] > 0 for r in rows)
