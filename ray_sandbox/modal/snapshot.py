"""``modal.snapshot``, where Modal before 1.6 kept ``SandboxSnapshot`` (1.6 exports it from
``modal``): code importing it from here runs too."""

from .sandbox import SandboxSnapshot

__all__ = ["SandboxSnapshot"]
