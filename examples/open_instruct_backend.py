"""open-instruct's ``SandboxBackend`` on ray_sandbox.

    # open-instruct is not on PyPI: a checkout of github.com/allenai/open-instruct on PYTHONPATH
    PYTHONPATH=/path/to/open-instruct python examples/open_instruct_backend.py

``install()`` adds ``"ray_sandbox"`` to open-instruct's ``create_backend``, so its generic
sandbox environment selects it with ``GenericSandboxEnvConfig(backend="ray_sandbox")``.
This script makes the calls that environment's ``reset`` and ``execute_bash`` make.
(open-instruct's package imports its GPU stack: run this where open-instruct installs.)
"""

from __future__ import annotations

from open_instruct.environments import backends

from ray_sandbox.integrations import open_instruct as ray_sandbox_oi


def main() -> None:
    ray_sandbox_oi.install(cpu=0.5)
    backend = backends.create_backend("ray_sandbox", image="ray-sandbox/python:latest",
                                      timeout=5, mem_limit="1g")
    backend.start()
    try:
        backend.run_command("mkdir -p /testbed/input /testbed/output")
        backend.write_file("/testbed/input/task.txt", "count the lines of this file\n")
        r = backend.run_command("cd /testbed && wc -l input/task.txt")
        print("execute_bash:", r.exit_code, r.stdout.strip())
        t = backend.run_command("echo working; sleep 60")  # past timeout=5: killed
        print("timeout:", t.exit_code, t.stderr.splitlines()[0])
        print("read_file:", backend.read_file("/testbed/input/task.txt").strip())
    finally:
        backend.close()


if __name__ == "__main__":
    main()
