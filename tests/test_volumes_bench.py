"""benchmarks/bench_volumes.py runs end to end with one round and a tiny cache: a smoke
test, not a measurement (benchmarks measure speed); it leaves nothing mounted."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_volumes import run


def test_bench_volumes_runs_with_one_round(busybox_image):
    before = Path("/proc/self/mountinfo").read_text().count("bench-volumes-")
    rows = run(1, size_mb=2)
    assert [r["label"] for r in rows] == [
        "create→ready, no volume (baseline)",
        "create→ready, read-write volume (mount + bind)",
        "create→ready, read-only volume already mounted (bind)",
        "read, own root (baseline)", "read, read-only volume"]
    assert all(r["n"] == 1 and r["p50_ms"] > 0 for r in rows)
    assert Path("/proc/self/mountinfo").read_text().count("bench-volumes-") == before
