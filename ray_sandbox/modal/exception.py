"""Modal's exception names (``modal.exception``): every class Modal 1.6 exports there.
The classes live in our one error tree (``ray_sandbox.runtime.errors``, the ``Modal*``
classes, whose docstring draws the tree); where one of ours means the same, Modal's is also
ours (``NotFoundError`` is a ``SandboxNotFoundError``, ``AlreadyExistsError`` a
``SandboxExistsError``, ``SandboxFilesystemNotFoundError`` a ``FileNotFoundError``, …)."""

from ..runtime.errors import ModalAlreadyExistsError as AlreadyExistsError
from ..runtime.errors import ModalAsyncUsageWarning as AsyncUsageWarning
from ..runtime.errors import ModalAuthError as AuthError
from ..runtime.errors import ModalClientClosed as ClientClosed
from ..runtime.errors import ModalConflictError as ConflictError
from ..runtime.errors import ModalConnectionError as ConnectionError  # noqa: A004 - Modal's name
from ..runtime.errors import ModalDataLossError as DataLossError
from ..runtime.errors import ModalDeprecationError as DeprecationError
from ..runtime.errors import ModalDeserializationError as DeserializationError
from ..runtime.errors import ModalError as Error
from ..runtime.errors import ModalExecTimeoutError as ExecTimeoutError
from ..runtime.errors import ModalExecutionError as ExecutionError
from ..runtime.errors import ModalFunctionTimeoutError as FunctionTimeoutError
from ..runtime.errors import ModalImageBuildError as ImageBuildError
from ..runtime.errors import ModalInputCancellation as InputCancellation
from ..runtime.errors import ModalInteractiveTimeoutError as InteractiveTimeoutError
from ..runtime.errors import ModalInternalAPIWarning as InternalAPIWarning
from ..runtime.errors import ModalInternalError as InternalError
from ..runtime.errors import ModalInternalFailure as InternalFailure
from ..runtime.errors import ModalInvalidError as InvalidError
from ..runtime.errors import ModalLogsFetchError as LogsFetchError
from ..runtime.errors import ModalModuleNotMountable as ModuleNotMountable
from ..runtime.errors import ModalMountUploadTimeoutError as MountUploadTimeoutError
from ..runtime.errors import ModalNotFoundError as NotFoundError
from ..runtime.errors import ModalOutputExpiredError as OutputExpiredError
from ..runtime.errors import ModalPermissionDeniedError as PermissionDeniedError
from ..runtime.errors import ModalRemoteError as RemoteError
from ..runtime.errors import ModalRequestSizeError as RequestSizeError
from ..runtime.errors import ModalResourceExhaustedError as ResourceExhaustedError
from ..runtime.errors import (
    ModalSandboxFilesystemDirectoryNotEmptyError as SandboxFilesystemDirectoryNotEmptyError,
)
from ..runtime.errors import ModalSandboxFilesystemError as SandboxFilesystemError
from ..runtime.errors import (
    ModalSandboxFilesystemFileTooLargeError as SandboxFilesystemFileTooLargeError,
)
from ..runtime.errors import (
    ModalSandboxFilesystemIsADirectoryError as SandboxFilesystemIsADirectoryError,
)
from ..runtime.errors import (
    ModalSandboxFilesystemNotADirectoryError as SandboxFilesystemNotADirectoryError,
)
from ..runtime.errors import ModalSandboxFilesystemNotFoundError as SandboxFilesystemNotFoundError
from ..runtime.errors import (
    ModalSandboxFilesystemPathAlreadyExistsError as SandboxFilesystemPathAlreadyExistsError,
)
from ..runtime.errors import (
    ModalSandboxFilesystemPermissionError as SandboxFilesystemPermissionError,
)
from ..runtime.errors import ModalSandboxTerminatedError as SandboxTerminatedError
from ..runtime.errors import ModalSandboxTimeoutError as SandboxTimeoutError
from ..runtime.errors import ModalSerializationError as SerializationError
from ..runtime.errors import ModalServerWarning as ServerWarning
from ..runtime.errors import ModalServiceError as ServiceError
from ..runtime.errors import ModalSnapshotCreationError as SnapshotCreationError
from ..runtime.errors import ModalTimeoutError as TimeoutError  # noqa: A004 - Modal's name
from ..runtime.errors import ModalUnimplementedError as UnimplementedError
from ..runtime.errors import ModalUserCodeException as UserCodeException
from ..runtime.errors import ModalVersionError as VersionError
from ..runtime.errors import ModalVolumeUploadTimeoutError as VolumeUploadTimeoutError
from ..runtime.errors import ModalWorkspaceManagementError as WorkspaceManagementError
from ._refuse import refused

simulate_preemption = refused("modal.exception.simulate_preemption", "a hook that preempts "
                              "a Modal Function's container; there are no Functions here")


__all__ = [
    "AlreadyExistsError", "AsyncUsageWarning", "AuthError", "ClientClosed", "ConflictError",
    "ConnectionError", "DataLossError", "DeprecationError", "DeserializationError", "Error",
    "ExecTimeoutError", "ExecutionError", "FunctionTimeoutError", "ImageBuildError",
    "InputCancellation", "InteractiveTimeoutError", "InternalAPIWarning", "InternalError",
    "InternalFailure", "InvalidError", "LogsFetchError", "ModuleNotMountable",
    "MountUploadTimeoutError", "NotFoundError", "OutputExpiredError", "PermissionDeniedError",
    "RemoteError", "RequestSizeError", "ResourceExhaustedError",
    "SandboxFilesystemDirectoryNotEmptyError", "SandboxFilesystemError",
    "SandboxFilesystemFileTooLargeError", "SandboxFilesystemIsADirectoryError",
    "SandboxFilesystemNotADirectoryError", "SandboxFilesystemNotFoundError",
    "SandboxFilesystemPathAlreadyExistsError", "SandboxFilesystemPermissionError",
    "SandboxTerminatedError", "SandboxTimeoutError", "SerializationError", "ServerWarning",
    "ServiceError", "SnapshotCreationError", "TimeoutError", "UnimplementedError",
    "UserCodeException", "VersionError", "VolumeUploadTimeoutError",
    "WorkspaceManagementError", "simulate_preemption",
]
