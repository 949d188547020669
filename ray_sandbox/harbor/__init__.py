"""A Harbor environment on ray_sandbox: ``harbor run -e ray_sandbox.harbor:RaySandboxEnvironment``
runs every trial in a gVisor sandbox placed by Ray. Needs the ``harbor`` extra (Python >= 3.12);
see docs/harbor.md."""

from ._environment import RaySandboxEnvironment, RaySandboxOptions

__all__ = ["RaySandboxEnvironment", "RaySandboxOptions"]
