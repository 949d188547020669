"""Load through the service (heavy): 200 sandboxes created over HTTP at once, each then
running execs while every other one polls its own, with no error; the figures are printed
(``-s``), not asserted (benchmarks measure speed)."""

from __future__ import annotations

import statistics
import time

import anyio

from ray_sandbox.client import AsyncSandboxClient
from tests.fx_hostile import skip_module_unless_heavy
from tests.fx_service import TOKENS, Service

skip_module_unless_heavy()

N = 200
EXECS = 3  # per sandbox, concurrently
SERVICE_QUOTAS = (f"alice:sandboxes={N},cpu={N},memory={N * 64}Mi",)
# all N at once from one tenant: its fair shares of a replica (creates in flight, requests
# and long polls; a 429 past each) are raised to what N sandboxes with EXECS execs each hold
SERVICE_SETTINGS = {"max_pending_creates": N, "max_requests_per_tenant": N * (EXECS + 1),
                    "max_long_polls_per_tenant": N * (EXECS + 1)}


def test_200_sandboxes_with_concurrent_exec_polling(service: Service):
    create_ms: list[float] = []
    exec_ms: list[float] = []
    wrong: list[str] = []

    async def one(c: AsyncSandboxClient, i: int) -> None:
        t0 = time.perf_counter()
        sb = await c.create(image="ray-sandbox/busybox", cpu=0.01, memory="32Mi",
                            labels={"suite": "load"}, timeout=900)
        create_ms.append((time.perf_counter() - t0) * 1000)

        async def run(k: int) -> None:
            t1 = time.perf_counter()
            res = await sb.exec(["echo", f"{i}-{k}"])
            exec_ms.append((time.perf_counter() - t1) * 1000)
            if (res.exit_code, res.stdout) != (0, f"{i}-{k}\n"):
                wrong.append(f"{i}-{k}: {res}")

        async with anyio.create_task_group() as tg:
            for k in range(EXECS):
                tg.start_soon(run, k)

    async def main() -> float:
        async with AsyncSandboxClient(service.url, TOKENS["alice"], timeout=900) as c:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(N):
                    tg.start_soon(one, c, i)
            elapsed = time.perf_counter() - t0
            assert len(await c.list({"suite": "load"})) == N
        return elapsed

    elapsed = anyio.run(main)
    assert wrong == []
    assert len(create_ms) == N and len(exec_ms) == N * EXECS

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))]

    print(f"\n{N} sandboxes x {EXECS} execs through the service in {elapsed:.1f} s; "
          f"create→running p50 {statistics.median(create_ms):.0f} ms p99 "
          f"{q(create_ms, 0.99):.0f} ms; exec p50 {statistics.median(exec_ms):.0f} ms "
          f"p99 {q(exec_ms, 0.99):.0f} ms")
