"""Credential injection: what the egress proxy adds to an HTTPS request, beside direct egress
in the same sandbox and the same run.

    .venv/bin/python -m benchmarks.bench_inject [--n 200] [--seconds 10]

Runs as root. The fake internet of the tests (rsbt-node/rsbt-inet) with two identical HTTPS
upstreams of the tests (tests/fx_inject.py: Python's ThreadingHTTPServer over TLS with a CA of
their own, in a process of their own): ``api.test``, whose requests get an injected
``Authorization`` through the sandbox's proxy, and ``other.test``, reached directly (the
baseline). A Python client inside
one ``ray-sandbox/python`` sandbox (``network="public"``) measures, with its own clock:

- latency per request on a new connection each time (TCP + TLS + GET + response);
- latency per request on one kept-alive connection;
- requests per second on new connections from 4 threads in 1 and in 3 sandboxes at once
  (connections per second through the node), direct and through the proxies alternated over
  3 rounds (the median round);
- create with and without ``inject`` (the CA and the proxy's start), and the network
  helper's memory with and without it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime, _subreaper
from ray_sandbox.runtime.network import state as _state
from tests.fx_inject import TEST_DNS, https_upstreams
from tests.fx_network import NODE, running_fake_internet

CA = "/tmp/upstream-ca.pem"
CLIENT = r"""
import http.client, json, ssl, sys, threading, time
host, cafile, mode, amount = sys.argv[1], sys.argv[2] or None, sys.argv[3], float(sys.argv[4])
ctx = ssl.create_default_context(cafile=cafile)
def new():
    c = http.client.HTTPSConnection(host, timeout=60, context=ctx)
    c.request("GET", "/bench")
    r = c.getresponse()
    r.read()
    c.close()
    assert r.status == 200, r.status
if mode == "new":
    new()
    out = []
    for _ in range(int(amount)):
        t0 = time.perf_counter(); new(); out.append((time.perf_counter() - t0) * 1000)
elif mode == "keep":
    c = http.client.HTTPSConnection(host, timeout=60, context=ctx)
    out = []
    for i in range(int(amount) + 1):
        t0 = time.perf_counter()
        c.request("GET", "/bench"); r = c.getresponse(); r.read()
        if i:
            out.append((time.perf_counter() - t0) * 1000)
else:  # rate: requests on new connections from 4 threads for `amount` seconds
    done, stop = [0] * 4, time.monotonic() + amount
    def loop(i):
        while time.monotonic() < stop:
            new(); done[i] += 1
    ts = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    out = sum(done)
print(json.dumps(out))
"""
EGRESS = {"allow_domains": ["api.test", "other.test"],
          "inject": [{"domain": "api.test", "headers": {"Authorization": "Bearer $TOKEN"},
                      "secret": "bench"}]}


def _run(rt: SandboxRuntime, sid: str, host: str, mode: str, amount: float) -> Any:
    cafile = CA if host == "other.test" else ""
    res = rt.exec(sid, ["python3", "/tmp/client.py", host, cafile, mode, str(amount)],
                  timeout=1800)
    if res.exit_code != 0:
        raise RuntimeError(res.stderr)
    return json.loads(res.stdout)


def _helper_rss_mib(rt: SandboxRuntime, sid: str) -> float:
    st = _state.load(rt.records.sdir(sid).path)
    assert st is not None
    pid = next(p.pid for p in st.procs if p.what == "dns")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _serve_upstreams(work: str) -> None:
    """The upstreams in a process of their own: in the benchmark's process their TLS and
    HTTP would share its interpreter lock with the benchmark's own threads."""
    with https_upstreams(Path(work)):
        (Path(work) / "ready").touch()
        time.sleep(3600)


def _create(rt: SandboxRuntime, egress: dict, ca_pem: str) -> str:
    sid = rt.create(image="ray-sandbox/python", network="public", dns=TEST_DNS, egress=egress,
                    memory="512Mi", cpu=2)
    rt.write_file(sid, "/tmp/client.py", CLIENT)
    rt.write_file(sid, CA, ca_pem)
    return sid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    _subreaper.ensure()
    load_before = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-inject-") as tmp, \
            running_fake_internet():
        upstreams = multiprocessing.get_context("spawn").Process(
            target=_serve_upstreams, args=(tmp,), daemon=True)
        upstreams.start()
        deadline = time.monotonic() + 60
        while not (Path(tmp) / "ready").exists():
            assert upstreams.is_alive() and time.monotonic() < deadline, "no upstreams"
            time.sleep(0.05)
        ca_file = Path(tmp) / "upstream-ca.pem"
        os.environ["RAY_SANDBOX_NET_UPSTREAM"] = NODE
        os.environ["RAY_SANDBOX_NET_INJECT_CA"] = str(ca_file)
        ca_pem = ca_file.read_text()
        with SandboxRuntime(Path(tmp) / "home", images=ImageStore()) as rt:
            rt.secrets.put("bench", {"TOKEN": secrets.token_hex(20)})
            # create, with and without inject, alternated
            plain_ms, inject_ms = [], []
            for i in range(10):
                for egress, out in (({"allow_domains": ["other.test"]}, plain_ms),
                                    (EGRESS, inject_ms))[:: 1 if i % 2 else -1]:
                    t0 = time.perf_counter()
                    sid = rt.create(image="ray-sandbox/python", network="public",
                                    dns=TEST_DNS, egress=egress, memory="256Mi")
                    out.append((time.perf_counter() - t0) * 1000)
                    rt.delete(sid)
            rows.append(summarize("create, network=public (baseline)", plain_ms))
            rows.append(summarize("create, network=public + inject", inject_ms))
            plain = _create(rt, {"allow_domains": ["other.test"]}, ca_pem)
            sids = [_create(rt, EGRESS, ca_pem) for _ in range(3)]
            sid = sids[0]
            rss_plain, rss_idle = _helper_rss_mib(rt, plain), _helper_rss_mib(rt, sid)
            rt.delete(plain)
            for mode in ("new", "keep"):
                for host, label in (("other.test", "direct (baseline)"),
                                    ("api.test", "through the proxy")):
                    samples = _run(rt, sid, host, mode, args.n)
                    what = "new connection" if mode == "new" else "kept-alive connection"
                    rows.append(summarize(f"HTTPS GET, {what}: {label}", samples))
            for k in (1, 3):
                rates: dict[str, list[float]] = {"other.test": [], "api.test": []}
                for _ in range(3):
                    for host in rates:
                        counts: list[int] = []

                        def one(s: str, host: str = host, counts: list[int] = counts) -> None:
                            counts.append(int(_run(rt, s, host, "rate", args.seconds)))

                        threads = [threading.Thread(target=one, args=(s,)) for s in sids[:k]]
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                        rates[host].append(sum(counts) / args.seconds)
                for host, label in (("other.test", "direct (baseline)"),
                                    ("api.test", "through the proxies")):
                    rows.append({"label": f"requests/s on new connections, {k} sandbox(es) x 4 "
                                          f"threads: {label}",
                                 "per_s": round(sorted(rates[host])[1], 1),
                                 "rounds": [round(r, 1) for r in rates[host]]})
            rss_used = _helper_rss_mib(rt, sid)
            rows.append({"label": "network helper RSS, MiB: without inject / with, idle / "
                                  "with, after the runs",
                         "mib": f"{rss_plain} / {rss_idle} / {rss_used}"})
            for s in sids:
                rt.delete(s)
            rt.secrets.delete("bench")
        upstreams.kill()  # ours, by its handle
        upstreams.join()
    load_after = os.getloadavg()
    emit("inject", rows, notes=f"load average before {load_before[0]:.2f}, after "
                               f"{load_after[0]:.2f}")


if __name__ == "__main__":
    main()
