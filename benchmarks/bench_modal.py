"""Modal's own client (``modal`` 1.6, unmodified, in a venv without Ray) against
``ray-sandbox serve --modal-port``, beside the HTTP API and the Ray handle, in the same run on
the same sandboxes (docs/modal.md).

    .venv/bin/python -m benchmarks.bench_modal [--reps N]

Rows (busybox, cpu=1, 128Mi, one local Ray node, the service on 127.0.0.1):
- ``exec true, Modal SDK``: ``sb.exec("true")`` then ``p.wait()`` (start + wait: two router
  calls), and with ``p.stdout.read()`` before the wait (start, one output stream, wait), timed
  inside the client's process;
- ``exec true, HTTP (one POST that waits)`` and ``exec true, Ray handle (baseline)``;
- ``Sandbox.create→first exec, Modal SDK``: ``Sandbox.create(image=from_registry(busybox))`` then
  ``exec("true").wait()``; ``create→first exec, HTTP``: POST /sandboxes, long-poll until running,
  one POST of the exec that waits. Sandboxes are deleted outside the timed part.
Goals (issue 34): SDK exec <= HTTP exec + 5 ms; SDK create→first exec <= 2x HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import ray

import ray_sandbox as sandbox
from benchmarks._harness import emit, measure, summarize
from ray_sandbox import service

OPTS = {"image": "ray-sandbox/busybox", "cpu": 1, "memory": "128Mi"}
TOKEN = "bench-token-0123456789"
PAUSE_S = 0.2
MODAL_SPEC = "modal>=1.6,<1.7"
CLIENT_VENV = Path(os.environ.get("RAY_SANDBOX_TEST_CACHE", "/var/tmp/ray_sandbox_test_cache")
                   ) / "modal-client-1.6"

SDK_EXEC = """
import json, sys, time
import modal

sid, reps, read = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "read"
sb = modal.Sandbox.from_id(sid)
out = []
for i in range(reps + 3):
    t0 = time.perf_counter()
    p = sb.exec("true")
    if read:
        p.stdout.read()
    assert p.wait() == 0
    if i >= 3:  # warm-up: the router channel, the first calls
        out.append((time.perf_counter() - t0) * 1000)
print(json.dumps(out))
"""

SDK_CREATE = """
import json, sys, time
import modal

reps = int(sys.argv[1])
app = modal.App.lookup("bench", create_if_missing=True)
image = modal.Image.from_registry("ray-sandbox/busybox")
out = []
for i in range(reps + 1):
    t0 = time.perf_counter()
    sb = modal.Sandbox.create(app=app, image=image, cpu=1, memory=128, timeout=300)
    assert sb.exec("true").wait() == 0
    ms = (time.perf_counter() - t0) * 1000
    sb.terminate()
    if i >= 1:  # warm-up: the app, the image, the client's auth token
        out.append(ms)
    time.sleep(0.2)
print(json.dumps(out))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_python() -> Path:
    """The Modal client's venv (no Ray), made once; the tests share it."""
    python = CLIENT_VENV / "bin/python"
    marker = CLIENT_VENV / ".installed"
    if not marker.is_file() or marker.read_text() != MODAL_SPEC:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(CLIENT_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", MODAL_SPEC, "requests"],
                       check=True)
        marker.write_text(MODAL_SPEC)
    return python


def _sdk(python: Path, modal_url: str, code: str, *args: str) -> list[float]:
    env = {"PATH": "/usr/bin:/bin", "HOME": tempfile.gettempdir(),
           "MODAL_SERVER_URL": modal_url, "MODAL_TOKEN_ID": "default",
           "MODAL_TOKEN_SECRET": TOKEN}
    res = subprocess.run([str(python), "-c", textwrap.dedent(code), *args], env=env,
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _http_exec(c: httpx.Client, sid: str) -> None:
    info = c.post(f"/sandboxes/{sid}/execs", params={"wait_seconds": 30},
                  json={"command": ["/bin/true"]}).raise_for_status().json()
    assert info["exit_code"] == 0, info


def _http_create_exec(c: httpx.Client) -> tuple[float, str]:
    t0 = time.perf_counter()
    sid = c.post("/sandboxes", json=OPTS).raise_for_status().json()["sandbox_id"]
    while c.get(f"/sandboxes/{sid}", params={"wait_seconds": 30}).json()["status"] == "pending":
        pass
    _http_exec(c, sid)
    return (time.perf_counter() - t0) * 1000, sid


def run(reps: int) -> list[dict]:
    python = client_python()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-modal-") as tmp:
        os.environ["RAY_SANDBOX_HOME"] = str(Path(tmp) / "home")
        os.environ["RAY_SANDBOX_STOCK_MAX"] = "0"  # count boots, as the other benches do
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        modal_port = _port()
        try:
            config = service.from_env({"RAY_SANDBOX_API_TOKEN": TOKEN}, modal_port=modal_port)
            url = service.start(config, "127.0.0.1", _port())
            modal_url = f"http://127.0.0.1:{modal_port}"
            deadline = time.monotonic() + 60
            while True:  # a replica binds the port in the background
                try:
                    socket.create_connection(("127.0.0.1", modal_port), timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            with httpx.Client(base_url=url, timeout=120,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                warm = sandbox.create(**OPTS)  # host actor up, image unpacked
                ray.get(warm.exec.remote("true"))
                # create -> first exec: HTTP, then the SDK (its own process, its own loop)
                http_ms = []
                for _ in range(reps):
                    ms, sid = _http_create_exec(c)
                    http_ms.append(ms)
                    c.delete(f"/sandboxes/{sid}")
                    time.sleep(PAUSE_S)
                sdk_ms = _sdk(python, modal_url, SDK_CREATE, str(reps))
                rows.append(summarize("create→first exec, Modal SDK", sdk_ms))
                rows.append(summarize("create→first exec, HTTP (baseline)", http_ms))

                sid = c.post("/sandboxes", json=OPTS).raise_for_status().json()["sandbox_id"]
                c.get(f"/sandboxes/{sid}", params={"wait_seconds": 60})
                same = next(h for h in sandbox.list() if h.name == sid)  # the same sandbox
                n = reps * 5
                rows.append(summarize("exec true, Modal SDK (exec, wait)",
                                      _sdk(python, modal_url, SDK_EXEC, f"sb-{sid}", str(n),
                                           "wait")))
                rows.append(summarize("exec true, Modal SDK (exec, stdout.read, wait)",
                                      _sdk(python, modal_url, SDK_EXEC, f"sb-{sid}", str(n),
                                           "read")))
                rows.append(measure("exec true, HTTP (one POST that waits)",
                                    lambda: _http_exec(c, sid), n, warmup=3))
                rows.append(measure("exec true, Ray handle (baseline)",
                                    lambda: ray.get(same.exec.remote(["/bin/true"])), n,
                                    warmup=3))
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
    emit("modal", rows, notes="goals: SDK exec p50 <= HTTP exec p50 + 5 ms; SDK create→first "
                              "exec <= 2x HTTP")


if __name__ == "__main__":
    main()
