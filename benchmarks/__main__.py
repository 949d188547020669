"""One entry point for every benchmark: run some (or all), then chart every saved result.

    .venv/bin/python -m benchmarks [runtime ray images python_image network snapshot suspend scale
                                    blocks cpu stock memory commands service ray_floor soak]
                                    [--quick]
    .venv/bin/python -m benchmarks --chart-only

Each benchmark prints its table and saves ``benchmarks/out/<name>.json``; this then renders
``benchmarks/out/summary.png``: p50 of every row that has one, ours beside the baseline.
"""

from __future__ import annotations

import json
import runpy
import sys

from benchmarks._harness import OUT

MODULES = {
    "runtime": "benchmarks.bench_runtime",
    "ray": "benchmarks.bench_ray",
    "images": "benchmarks.bench_images",
    "python_image": "benchmarks.bench_python_image",
    "network": "benchmarks.bench_network",
    "snapshot": "benchmarks.bench_snapshot",
    "suspend": "benchmarks.bench_suspend",
    "scale": "benchmarks.bench_scale",
    "blocks": "benchmarks.bench_blocks",
    "cpu": "benchmarks.bench_cpu",
    "stock": "benchmarks.bench_stock",
    "service": "benchmarks.bench_service",
    "ray_floor": "benchmarks.bench_ray_floor",
    "memory": "benchmarks.bench_memory",
    "commands": "benchmarks.bench_commands",
    "soak": "benchmarks.soak",
}


def chart() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    panels = [(r["name"], [row for row in r["rows"] if "p50_ms" in row])
              for r in results if "rows" in r]  # the soak writes leak samples, not rows
    panels = [(n, rows) for n, rows in panels if rows]
    if not panels:
        print("no results with p50 rows yet")
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 + 0.32 * sum(
        len(rows) for _, rows in panels)), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels, strict=True):
        labels = [row["label"][:70] for row in rows]
        values = [row["p50_ms"] for row in rows]
        colors = ["#888888" if "baseline" in row["label"] else "#1f77b4" for row in rows]
        ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{name}: p50 ms (grey = baseline, log scale)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = OUT / "summary.png"
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main(argv: list[str]) -> None:
    flags = [a for a in argv if a.startswith("--")]
    names = [a for a in argv if not a.startswith("--")]
    if "--chart-only" not in flags:
        for name in names or ["runtime", "ray"]:
            sys.argv = [MODULES[name], *[f for f in flags if f == "--quick"]]
            runpy.run_module(MODULES[name], run_name="__main__")
    chart()


if __name__ == "__main__":
    main(sys.argv[1:])
