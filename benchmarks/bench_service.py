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
  stdout line arrives;
- ``GET /health, HTTP``: Serve's own floor for one request.
With ``--direct-ingress`` Ray is started with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (Ray 2.60's
feature flag: the ingress replica answers HTTP itself, on a port from 30000, beside the proxy)
and the exec and health rows are also measured against the replica's own port.
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


def _replica_url(proxy_url: str) -> str:
    """The ingress replica's own HTTP address (direct ingress), from Serve's controller: its
    target groups (``ray.serve.schema.TargetGroup``) have no public getter in Ray 2.60."""
    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for group in ray.get(controller.get_target_groups.remote()):
            for t in group.targets:
                if str(group.protocol).endswith("HTTP") and t.port >= 30000:
                    return proxy_url.replace(proxy_url.split("/")[2], f"127.0.0.1:{t.port}")
        time.sleep(0.5)
    raise RuntimeError("no direct-ingress replica port (is RAY_SERVE_ENABLE_DIRECT_INGRESS set?)")


def run(reps: int, direct_ingress: bool = False) -> list[dict]:
    rows = []
    if direct_ingress:  # before ray.init: the controller and replicas read it at start
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
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
                rows.append(measure("GET /health, HTTP (Serve's floor)",
                                    lambda: c.get("/health"), reps * 5, warmup=3))
                if direct_ingress:
                    with httpx.Client(base_url=_replica_url(url), timeout=120,
                                      headers=dict(c.headers)) as d:
                        rows.append(measure(
                            "exec round trip, HTTP direct ingress (one POST that waits)",
                            lambda: _http_exec_waiting(d, sid), reps * 5, warmup=3))
                        rows.append(measure("GET /health, HTTP direct ingress",
                                            lambda: d.get("/health"), reps * 5, warmup=3))
                    rows.append(measure("exec round trip, Ray handle (baseline, again)",
                                        lambda: ray.get(same.exec.remote(["/bin/true"])),
                                        reps * 5, warmup=3))
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
    ap.add_argument("--direct-ingress", action="store_true",
                    help="also measure Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS)")
    args = ap.parse_args()
    rows = run(args.reps, args.direct_ingress)
    emit("service", rows, notes="goal: HTTP exec round trip p50 <= Ray handle p50 + 3 ms")


if __name__ == "__main__":
    main()
