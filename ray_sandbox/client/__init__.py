"""A client of the sandbox service (docs/service.md) that needs no Ray: httpx and pydantic
(``pip install 'ray_sandbox[client]'``).

    from ray_sandbox.client import SandboxClient
    with SandboxClient("http://sandboxes:8000", token) as c:
        sb = c.create(image="ray-sandbox/python", cpu=1, memory="512Mi")
        print(sb.exec("python3 -c 'print(1)'").stdout)
    # the sandboxes it created are deleted here

Failures raise the same error classes as the Ray layer (``ray_sandbox.SandboxNotFoundError``,
``ray_sandbox.CapacityError`` for a quota, …).
"""

from ._async import AsyncSandbox, AsyncSandboxClient
from ._sync import Sandbox, SandboxClient

__all__ = ["AsyncSandbox", "AsyncSandboxClient", "Sandbox", "SandboxClient"]
