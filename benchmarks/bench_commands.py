"""Real commands, not only ``true`` (issue 20): what a rollout runs, timed in a sandbox on
ptrace and on systrap, beside ``runsc exec`` of the same command and the host itself, in
one run with the samples interleaved.

    .venv/bin/python -m benchmarks.bench_commands [--reps 15]

Image ``ray-sandbox/python`` (Debian python3, bash, coreutils), cpu=1, 512Mi. Where the time
goes is in docs/runtime.md, "Exec": syscalls and page faults, each a trip to the sentry.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import SandboxRuntime

COMMANDS = {
    "/bin/true": ["/bin/true"],
    "python3 -S -c pass": ["python3", "-S", "-c", "pass"],
    "python3 -c pass": ["python3", "-c", "pass"],
    "python3 -c 'import json, re'": ["python3", "-c", "import json, re"],
    "bash -c 'ls /'": ["bash", "-c", "ls / >/dev/null"],
}
PLATFORMS = ("ptrace", "systrap")


def _host_argv(argv: list[str]) -> list[str]:
    """The host's own binary (a pyenv shim on PATH would time bash, not python)."""
    return [shutil.which(argv[0], path="/usr/bin:/bin") or argv[0], *argv[1:]]


def _ms(way, argv: list[str]) -> float:
    t0 = time.perf_counter()
    way(argv)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    reps = ap.parse_args().reps
    samples: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rsb-bench-cmd-") as tmp, \
            SandboxRuntime(Path(tmp) / "home") as rt:
        sbs = {p: rt.create(image="ray-sandbox/python", cpu=1, memory="512Mi", platform=p)
               for p in PLATFORMS}

        def agent(sid: str, argv: list[str]) -> None:
            r = rt.exec(sid, argv)
            if r.exit_code != 0:
                raise RuntimeError(f"{argv}: {r.stderr}")

        ways = {f"in sandbox, {p}": (lambda argv, sid=sid: agent(sid, argv))
                for p, sid in sbs.items()}
        ways["runsc exec, ptrace (baseline)"] = lambda argv: rt.runsc.exec(
            sbs["ptrace"], argv, timeout=60)
        ways["host (baseline)"] = lambda argv: subprocess.run(
            _host_argv(argv), check=True, stdout=subprocess.DEVNULL)
        for way in ways.values():  # warm: page cache, pyc files, connections
            for argv in COMMANDS.values():
                way(argv)
        for _ in range(reps):
            for name, argv in COMMANDS.items():
                for label, way in ways.items():
                    samples.setdefault((name, label), []).append(_ms(way, argv))
        for sid in sbs.values():
            rt.delete(sid)
    rows = [summarize(f"{name} — {label}", s) for (name, label), s in samples.items()]
    emit("commands", rows, notes=f"{reps} interleaved rounds; ray-sandbox/python, cpu=1")


if __name__ == "__main__":
    main()
