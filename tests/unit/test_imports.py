"""What importing a piece of the package pulls in. The DNS helper every public/sandbox sandbox
starts runs ``python -m ray_sandbox.runtime.network.dns`` on the create path: when the package's
``__init__`` pulled the runtime's pydantic models into it, public creates took ~50 ms longer
(benchmarks/RESULTS.md). Checked by module, not by time."""

from __future__ import annotations

import subprocess
import sys


def _imported_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    return set(out.stdout.split())


def test_dns_helper_imports_no_pydantic_and_no_ray():
    mods = _imported_after("import ray_sandbox.runtime.network.dns")
    assert "pydantic" not in mods and "ray" not in mods
    assert "ray_sandbox.runtime.sandbox" not in mods


def test_runtime_does_not_import_ray():
    mods = _imported_after("from ray_sandbox.runtime import SandboxRuntime")
    assert "ray_sandbox.runtime.sandbox" in mods and "ray" not in mods


def test_public_names_resolve():
    import ray_sandbox
    import ray_sandbox.runtime

    for name in ray_sandbox.runtime.__all__:
        assert getattr(ray_sandbox.runtime, name) is not None
    for name in ("SandboxRuntime", "SandboxConfig", "SandboxError", "ExecResult"):
        assert getattr(ray_sandbox, name) is not None
