"""What the service's books cost per step (``service/_state.py``): the two steps of every exec
(``exec_started`` + ``exec_finished``) and of every create (``admit`` + ``created``), on the
books' SQLite file (and PostgreSQL with ``--postgres URL``), beside the same steps on books
whose SQLite file is on tmpfs (no disk: the SQL alone), in the same run.

    .venv/bin/python -m benchmarks.bench_books [--n 2000] [--postgres postgresql://…]

Run from an older tree (``PYTHONPATH=<export of it>``) whose books were memory only, the same
rows measure those (its ``BOOKS_VERSION`` is below 4): the before of the HTTP exec's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, measure
from ray_sandbox.service import _state

BOUNDS = {"max_execs_per_sandbox": 64, "max_errored": 64, "max_snapshots": 16,
          "max_fs_images": 8, "create_timeout": 600.0, "max_running_execs_per_tenant": 128,
          "max_result_bytes_per_tenant": 32 << 20}
QUOTA = {"sandboxes": 1 << 30, "cpu": 1e12, "memory": 1 << 60}


def _books(db: str | None) -> Any:
    bounds = _state.Bounds(**BOUNDS)
    if _state.BOOKS_VERSION < 4:  # an older tree: memory only
        return _state.Books(bounds)
    return _state.Books(bounds, db)


def rows_for(label: str, db: str | None, n: int) -> list[dict]:
    books = _books(db)
    loop = asyncio.new_event_loop()
    count = iter(range(10 * n + 100))
    loop.run_until_complete(books.reconcile("t", {}, loop.run_until_complete(books.epoch())))

    def one_exec() -> None:
        i = next(count)
        loop.run_until_complete(books.exec_started("t", "s" * 32, f"e{i}", 60))
        loop.run_until_complete(books.exec_finished("s" * 32, f"e{i}", {
            "exec_id": f"e{i}", "status": "completed", "exit_code": 0, "stdout": ""}))

    def one_create() -> None:
        key = f"c{next(count)}"
        loop.run_until_complete(books.admit("t", QUOTA, [key], 0.1, 1, {"image": "x"}))
        loop.run_until_complete(books.created(key, None))

    try:
        return [measure(f"exec's two steps, {label}", one_exec, n, warmup=50),
                measure(f"create's two steps, {label}", one_create, n // 4, warmup=10)]
    finally:
        loop.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--postgres", help="a PostgreSQL database to measure too (its URL)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rsb-bench-books-") as tmp, \
            tempfile.TemporaryDirectory(prefix="rsb-bench-books-", dir="/dev/shm") as shm:
        where = "SQLite file" if _state.BOOKS_VERSION >= 4 else "memory only"
        rows = rows_for(f"books v{_state.BOOKS_VERSION}, {where}",
                        str(Path(tmp) / "books.sqlite3"), args.n)
        if _state.BOOKS_VERSION >= 4:
            rows += rows_for("SQLite file on tmpfs (baseline: no disk)",
                             str(Path(shm) / "books.sqlite3"), args.n)
        if args.postgres:
            rows += rows_for("PostgreSQL", args.postgres, args.n)
    emit("books", rows, notes="per step of the service's books; a replica adds these to "
                              "every exec and create it serves")


if __name__ == "__main__":
    main()
