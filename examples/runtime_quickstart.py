"""The README's first command: build the default image offline, start a sandbox, run Python
in it, print the result."""

from ray_sandbox.runtime import SandboxRuntime

CODE = """
import platform, sys
print(f"Python {sys.version.split()[0]} on {platform.system()} {platform.release()}")
print("sum of squares below 1000:", sum(i * i for i in range(1000)))
"""

with SandboxRuntime() as runtime:
    sb = runtime.create(image="ray-sandbox/python", memory="512Mi", cpu=1)
    result = runtime.exec(sb, ["python3", "-c", CODE])
    print(result.stdout, end="")
    print(f"exit code {result.exit_code} in {result.duration_seconds * 1000:.1f} ms")
    probe = runtime.exec(sb, "cat /proc/meminfo | head -1; touch /etc/x 2>&1; echo done")
    print(probe.stdout, end="")
