"""The HTTP service (issue 21) beside the Ray handle, in the same run on the same sandboxes.

    .venv/bin/python -m benchmarks.bench_service [--reps N]

Rows (busybox, cpu=1, 128Mi, one local Ray node, the service on 127.0.0.1 through Serve's
proxy, one keep-alive httpx connection):
- ``create→first exec, HTTP``: POST /sandboxes, long-poll GET until running, POST an exec,
  long-poll its result; the sandbox is deleted outside the timed part;
- ``create→first exec, Ray handle (baseline)``: ``create()`` then ``ray.get(exec)``;
- ``exec round trip, HTTP``: ``/bin/true`` as POST + long-poll GET on a running sandbox, and
  as one POST with ``wait_seconds`` that answers with the result;
- ``exec round trip, Ray handle (baseline)``: ``ray.get(sb.exec.remote(...))`` on the same;
- ``first streamed byte, HTTP``: POST .../execs/stream of ``echo x`` until the first
  stdout line arrives.
The goal: HTTP exec round trip p50 <= Ray-handle p50 + 3 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import httpx
import ray

import ray_sandbox as sandbox
from benchmarks._harness import emit, measure, summarize
from ray_sandbox import service

OPTS = {"image": "ray-sandbox/busybox", "cpu": 1, "memory": "128Mi"}  # gVisor: ~0.1 MiB per exec
TOKEN = "bench-token-0123456789"
PAUSE_S = 0.2  # between creates: the delete before it reaches the scheduler asynchronously


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_exec(c: httpx.Client, sid: str) -> None:
    r = c.post(f"/sandboxes/{sid}/execs", json={"command": ["/bin/true"]})
    exec_id = r.raise_for_status().json()["exec_id"]
    while True:
        info = c.get(f"/sandboxes/{sid}/execs/{exec_id}", params={"wait_seconds": 30}).json()
        if info["status"] != "running":
            assert info["exit_code"] == 0, info
            return


def _http_exec_waiting(c: httpx.Client, sid: str) -> None:
    """One request: the POST waits for the command and answers with its result."""
    r = c.post(f"/sandboxes/{sid}/execs", params={"wait_seconds": 30},
               json={"command": ["/bin/true"]})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text


def _http_create_exec(c: httpx.Client) -> tuple[float, str]:
    t0 = time.perf_counter()
    sid = c.post("/sandboxes", json=OPTS).raise_for_status().json()["sandbox_id"]
    while c.get(f"/sandboxes/{sid}", params={"wait_seconds": 30}).json()["status"] == "pending":
        pass
    _http_exec(c, sid)
    return (time.perf_counter() - t0) * 1000, sid


def _first_streamed_byte(c: httpx.Client, sid: str) -> None:
    with c.stream("POST", f"/sandboxes/{sid}/execs/stream",
                  json={"command": "echo x"}) as r:
        for line in r.iter_lines():
            if json.loads(line)["type"] in ("stdout", "exit"):
                return


def run(reps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-service-") as tmp:
        os.environ["RAY_SANDBOX_HOME"] = str(Path(tmp) / "home")
        os.environ["RAY_SANDBOX_STOCK_MAX"] = "0"  # count boots, as the other benches do
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            url = service.start(service.from_env({"RAY_SANDBOX_API_TOKEN": TOKEN}),
                                "127.0.0.1", _port())
            with httpx.Client(base_url=url, timeout=120,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                warm = sandbox.create(**OPTS)  # host actor up, image unpacked
                ray.get(warm.exec.remote("true"))
                http_ms, handle_ms = [], []
                for _ in range(reps):
                    ms, sid = _http_create_exec(c)
                    http_ms.append(ms)
                    c.delete(f"/sandboxes/{sid}")
                    time.sleep(PAUSE_S)
                    t0 = time.perf_counter()
                    sb = sandbox.create(**OPTS)
                    ray.get(sb.exec.remote(["/bin/true"]))
                    handle_ms.append((time.perf_counter() - t0) * 1000)
                    ray.get(sb.terminate.remote())
                    time.sleep(PAUSE_S)
                rows.append(summarize("create→first exec, HTTP", http_ms))
                rows.append(summarize("create→first exec, Ray handle (baseline)", handle_ms))

                sid = c.post("/sandboxes", json=OPTS).raise_for_status().json()["sandbox_id"]
                c.get(f"/sandboxes/{sid}", params={"wait_seconds": 60})
                same = next(h for h in sandbox.list() if h.name == sid)  # the same sandbox
                rows.append(measure("exec round trip, HTTP (POST, then long-poll GET)",
                                    lambda: _http_exec(c, sid), reps * 5, warmup=3))
                rows.append(measure("exec round trip, HTTP (one POST that waits)",
                                    lambda: _http_exec_waiting(c, sid), reps * 5, warmup=3))
                rows.append(measure("exec round trip, Ray handle (baseline)",
                                    lambda: ray.get(same.exec.remote(["/bin/true"])),
                                    reps * 5, warmup=3))
                rows.append(measure("first streamed byte, HTTP",
                                    lambda: _first_streamed_byte(c, sid), reps * 2, warmup=1))
                c.delete(f"/sandboxes/{sid}")
                ray.get(warm.terminate.remote())
        finally:
            service.stop()
            sandbox.shutdown()
            ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = run(args.reps)
    emit("service", rows, notes="goal: HTTP exec round trip p50 <= Ray handle p50 + 3 ms")


if __name__ == "__main__":
    main()
