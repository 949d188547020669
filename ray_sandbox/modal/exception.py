"""Modal's exception names (``modal.exception``). The classes live in our one error tree
(``ray_sandbox.runtime.errors``, the ``Modal*`` classes); ``NotFoundError`` is also a
``SandboxNotFoundError``, ``InvalidError`` also a ``ConfigError``."""

from ..runtime.errors import ModalError as Error
from ..runtime.errors import ModalExecTimeoutError as ExecTimeoutError
from ..runtime.errors import ModalInvalidError as InvalidError
from ..runtime.errors import ModalNotFoundError as NotFoundError
from ..runtime.errors import ModalSandboxTerminatedError as SandboxTerminatedError
from ..runtime.errors import ModalSandboxTimeoutError as SandboxTimeoutError
from ..runtime.errors import ModalTimeoutError as TimeoutError  # noqa: A004 - Modal's name

__all__ = ["Error", "ExecTimeoutError", "InvalidError", "NotFoundError",
           "SandboxTerminatedError", "SandboxTimeoutError", "TimeoutError"]
