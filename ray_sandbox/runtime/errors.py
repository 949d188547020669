"""Every error ray_sandbox raises.

(Over 600 lines on purpose: the one error tree the brief asks for, with each class's own
docstring and Ray's and Modal's names beside ours; split, a reader would look for a class
in several files and a caller could import two trees.)

    SandboxError                      root of runtime failures; carries sandbox_id, argv, stderr
    ├── SandboxTimeoutError           Ray's name: an operation ran out of time; base of
    │                                 CommandTimeoutError, AgentTimeoutError, ImageBusyError
    ├── SandboxExecError              Ray's name: a command could not be run; base of ExecError
    ├── ConfigError (ValueError)      bad configuration or arguments, rejected before any work
    │   ├── VolumeExistsError         a volume of that name exists already
    │   └── SandboxExistsError        a live sandbox has that name already (Ray: ValueError)
    ├── ToolMissingError              a required binary (runsc, umoci, skopeo, …) is not installed
    ├── CommandError                  an external tool failed; argv, returncode and stderr attached
    │   └── CommandTimeoutError       … or did not finish in time (it was killed)
    ├── ImageError                    anything about images; those marked * are also
    │   │                             SandboxCreationError (an image a create could not get)
    │   ├── ImageReferenceError *     unparsable reference
    │   ├── ImageNotFoundError *      no such image/tag in the source or the local store
    │   ├── RegistryUnreachableError * registry did not answer
    │   ├── RegistryAuthError *       registry refused the credentials
    │   ├── PlatformNotFoundError *   the image has no manifest for the requested platform
    │   ├── ImageCorruptError *       archive/layout/layer is damaged
    │   ├── StoreFullError *          no space left for the image store
    │   ├── ImageInUseError           pinned by a live sandbox: not removed
    │   └── ImageBusyError            (also TimeoutError) its lock was held past the timeout
    ├── SandboxCreationError          a sandbox could not be created (nothing is left behind)
    │   ├── CapacityError             no room for it (a node, or the cluster within timeout=)
    │   └── BatchCreateError          some sandboxes of a create_many failed (.errors per index)
    ├── SandboxNotFoundError          unknown or already deleted sandbox id
    │   ├── SnapshotNotFoundError     unknown, deleted or orphaned snapshot id
    │   └── VolumeNotFoundError       no volume of that name
    ├── SandboxStateError             operation not allowed in the sandbox's current state
    │   ├── HostRetiringError         the node's Ray host is retiring; a fresh one can serve
    │   ├── ResumeError               a suspended sandbox could not be resumed; its state is
    │   │                             kept on disk and the next call tries again
    │   └── VolumeInUseError          the volume is mounted and the operation needs it idle
    ├── SandboxDiedError              the sandbox died during the call (OOM kill, crash)
    │   └── AgentTimeoutError         agent missed a deadline (hung, stopped); also TimeoutError
    ├── AgentProtocolError            the agent broke the wire protocol (broken or replaced)
    ├── SnapshotCorruptError          a snapshot's files are incomplete or damaged
    ├── ExecError (SandboxExecError)  a command could not be started (bad cwd, user, …)
    ├── SandboxFileError              file operation failed inside the sandbox
    │   ├── SandboxFileNotFoundError  (also FileNotFoundError)
    │   ├── SandboxIsADirectoryError  (also IsADirectoryError)
    │   ├── SandboxNotADirectoryError (also NotADirectoryError)
    │   ├── SandboxFileExistsError    (also FileExistsError)
    │   ├── SandboxPermissionError    (also PermissionError)
    │   ├── UnsafePathError           a path or archive member would escape its target
    │   └── FileTooLargeError         a file is larger than the call's max_bytes
    ├── NetworkError                  network namespace / egress setup failed
    └── SessionError                  MCP: unknown session, or at the session limit

    Under Modal's names (``ray_sandbox.modal.exception``: every class Modal 1.6 exports there;
    what the Modal facade raises itself; in parentheses what else catches it):
    ModalError "Error"                root of them, a SandboxError
    ├── ModalInvalidError "InvalidError" (ConfigError)
    │   └── ModalConflictError "ConflictError"  e.g. wait_until_ready without a probe
    ├── ModalNotFoundError "NotFoundError" (SandboxNotFoundError)
    ├── ModalAlreadyExistsError "AlreadyExistsError" (SandboxExistsError)
    ├── ModalSandboxTerminatedError "SandboxTerminatedError"
    ├── ModalTimeoutError "TimeoutError" (TimeoutError)
    │   ├── ModalSandboxTimeoutError "SandboxTimeoutError"
    │   ├── ModalExecTimeoutError "ExecTimeoutError"
    │   └── Function-, MountUpload-, VolumeUpload-, Interactive- and OutputExpired-
    │       TimeoutError (Modal's names; nothing here raises them)
    ├── ModalRemoteError "RemoteError"
    │   └── ModalImageBuildError "ImageBuildError" (ImageBuildError)  an image DSL build failed
    ├── ModalSandboxFilesystemError "SandboxFilesystemError" (SandboxFileError)  sb.filesystem
    │   ├── …NotFoundError (SandboxFileNotFoundError), …IsADirectoryError
    │   │   (SandboxIsADirectoryError), …NotADirectoryError (SandboxNotADirectoryError),
    │   │   …PathAlreadyExistsError (SandboxFileExistsError), …PermissionError
    │   │   (SandboxPermissionError), …FileTooLargeError (FileTooLargeError)
    │   └── …DirectoryNotEmptyError   (names "SandboxFilesystem…Error")
    └── ClientClosed, AuthError, ConnectionError, DataLossError, DeserializationError,
        ExecutionError, InternalError, InternalFailure, LogsFetchError,
        PermissionDeniedError, RequestSizeError, ResourceExhaustedError, SerializationError,
        ServiceError, SnapshotCreationError, UnimplementedError, VersionError,
        WorkspaceManagementError (Modal's names, for ``except`` clauses)
    Modal's warnings AsyncUsageWarning, DeprecationError, InternalAPIWarning, ServerWarning
    (UserWarning), InputCancellation (BaseException), ModuleNotMountable and
    UserCodeException (Exception) are here too, under the same public module.

    ProtocolError (ValueError)        a malformed agent frame, raised by the pure wire codec and
                                      turned into AgentProtocolError at the one connection
                                      boundary (agent/conn.py); never reaches a caller
    ProxyRefusal                      an HTTP request a sandbox's egress proxy answers itself
                                      (status and reason: network/inject.py); it goes back to
                                      the sandbox as that response, never to a caller

A command that runs and exits non-zero is a result (``ExecResult.exit_code``), never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "SandboxError",
    "ConfigError",
    "ToolMissingError",
    "CommandError",
    "CommandTimeoutError",
    "ImageError",
    "ImageReferenceError",
    "ImageNotFoundError",
    "RegistryUnreachableError",
    "RegistryAuthError",
    "PlatformNotFoundError",
    "ImageCorruptError",
    "StoreFullError",
    "SandboxCreationError",
    "CapacityError",
    "BatchCreateError",
    "SandboxNotFoundError",
    "SandboxStateError",
    "SnapshotNotFoundError",
    "SnapshotCorruptError",
    "SandboxDiedError",
    "AgentTimeoutError",
    "AgentProtocolError",
    "ExecError",
    "SandboxFileError",
    "SandboxFileNotFoundError",
    "SandboxIsADirectoryError",
    "SandboxNotADirectoryError",
    "SandboxFileExistsError",
    "SandboxPermissionError",
    "UnsafePathError",
    "FileTooLargeError",
    "NetworkError",
    "ImageInUseError",
    "ImageBusyError",
    "ImageBuildError",
    "VolumeExistsError",
    "SandboxExistsError",
    "VolumeNotFoundError",
    "VolumeInUseError",
    "HostRetiringError",
    "ResumeError",
    "SessionError",
    "SandboxExecError",
    "SandboxTimeoutError",
]


class SandboxError(Exception):
    """Root of every ray_sandbox failure."""

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str | None = None,
        argv: Sequence[str] | None = None,
        returncode: int | None = None,
        stderr: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id
        self.argv = list(argv) if argv is not None else None
        self.returncode = returncode
        self.stderr = stderr

    def __str__(self) -> str:
        parts = [self.message]
        if self.sandbox_id:
            parts.append(f"sandbox={self.sandbox_id}")
        if self.argv:
            parts.append(f"command={' '.join(self.argv)!r}")
        if self.returncode is not None:
            parts.append(f"exit={self.returncode}")
        if self.stderr:
            parts.append(f"stderr={self.stderr.strip()[-2000:]!r}")
        return " | ".join(parts)

    def __reduce__(  # keep the attributes when Ray pickles the error
        self,
    ) -> tuple[Callable[..., SandboxError], tuple[Any, ...]]:
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))


def _rebuild(cls: type[SandboxError], message: str, state: dict[str, Any]) -> SandboxError:
    err = cls.__new__(cls, message)
    SandboxError.__init__(err, message)
    err.__dict__.update(state)
    return err


class SandboxTimeoutError(SandboxError):
    """An operation ran out of time (Ray's name). An exec whose own ``timeout`` fires is a
    result (``ExecResult.timed_out``), not this error. Not itself a TimeoutError (an
    OSError), so ``except OSError`` around a tool call never swallows a killed tool."""


class SandboxExecError(SandboxError):
    """A command could not be run (Ray's name); a non-zero exit is a result, not this."""


class ConfigError(SandboxError, ValueError):
    """Invalid configuration or arguments; raised before anything is created."""


class ToolMissingError(SandboxError):
    """A required external binary is not installed."""


class CommandError(SandboxError):
    """An external tool (runsc, umoci, skopeo, …) exited with an error."""


class CommandTimeoutError(CommandError, SandboxTimeoutError):
    """An external tool did not finish in time and was killed."""


class ImageError(SandboxError):
    """Base class for image failures."""


class SandboxCreationError(SandboxError):
    """A sandbox could not be created; nothing of it was left behind."""


class ImageReferenceError(ImageError, SandboxCreationError, ValueError):
    """The image reference cannot be parsed."""


class ImageNotFoundError(ImageError, SandboxCreationError):
    """The image (or tag/digest) does not exist where it was looked for."""


class RegistryUnreachableError(ImageError, SandboxCreationError):
    """The registry could not be reached."""


class RegistryAuthError(ImageError, SandboxCreationError):
    """The registry refused the credentials (or demanded some)."""


class PlatformNotFoundError(ImageError, SandboxCreationError):
    """The image index has no manifest for the requested OS/architecture."""


class ImageCorruptError(ImageError, SandboxCreationError):
    """An archive, layout or layer is damaged or not an image."""


class StoreFullError(ImageError, SandboxCreationError):
    """The disk holding the image store is full."""


class CapacityError(SandboxCreationError):
    """No room for the sandbox: on a node (the caller tries another) or, within ``timeout=``,
    anywhere in the cluster; the message says what is missing."""


class BatchCreateError(SandboxCreationError):
    """Some sandboxes of a ``create_many`` failed; ``errors`` maps each failed index to its
    error. The ones that were made are deleted (nothing is left behind)."""

    errors: dict[int, SandboxError]


class SandboxNotFoundError(SandboxError, KeyError):
    """No sandbox with this id exists (or it was deleted)."""

    __str__ = SandboxError.__str__


class SnapshotNotFoundError(SandboxNotFoundError):
    """No snapshot with this id on the node (never taken, deleted, or its owner died)."""


class SnapshotCorruptError(SandboxError):
    """The snapshot's files are incomplete or damaged; it cannot be restored."""


class SandboxStateError(SandboxError):
    """The operation is not allowed in the sandbox's current state."""


class SandboxDiedError(SandboxError):
    """The sandbox stopped while the call was running (OOM kill, crash, delete)."""


class AgentTimeoutError(SandboxDiedError, SandboxTimeoutError, TimeoutError):
    """The sandbox's agent did not answer, or take the data sent, before the call's deadline:
    it hangs or its handler was stopped (SIGSTOP from inside). The connection was dropped."""

    __str__ = SandboxError.__str__


class AgentProtocolError(SandboxError):
    """The agent sent something the protocol does not allow (too large, too much, malformed,
    out of order): a broken agent, or a server that code in the sandbox put in its place. The
    connection was dropped; the sandbox itself may still be running."""


class ExecError(SandboxExecError):
    """A command could not be started (bad cwd, unknown user, bad env)."""


class SandboxFileError(SandboxError):
    """A file operation inside the sandbox failed."""

    errno: int | None  # the agent's errno, on the errors the agent reported (as OSError's)


class SandboxFileNotFoundError(SandboxFileError, FileNotFoundError):
    __str__ = SandboxError.__str__


class SandboxIsADirectoryError(SandboxFileError, IsADirectoryError):
    __str__ = SandboxError.__str__


class SandboxNotADirectoryError(SandboxFileError, NotADirectoryError):
    __str__ = SandboxError.__str__


class SandboxFileExistsError(SandboxFileError, FileExistsError):
    __str__ = SandboxError.__str__


class SandboxPermissionError(SandboxFileError, PermissionError):
    __str__ = SandboxError.__str__


class UnsafePathError(SandboxFileError, ValueError):
    """A path or archive member would land outside its target."""


class FileTooLargeError(SandboxFileError):
    """A file read from a sandbox is larger than the call's ``max_bytes`` (nothing kept)."""


class NetworkError(SandboxError):
    """Network namespace, egress tool or policy setup failed."""


class ImageInUseError(ImageError):
    """The image is pinned by a live sandbox and cannot be removed."""


class ImageBusyError(ImageError, SandboxTimeoutError, TimeoutError):
    """Another thread or process held the image's lock for longer than the timeout."""


class ImageBuildError(ImageError):
    """An image build (a Dockerfile step run in a build sandbox) failed. ``step`` names the
    failing step, ``log_tail`` holds the end of the build's output."""

    def __init__(self, message: str, *, step: str | None = None, log_tail: str = "",
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.step = step
        self.log_tail = log_tail


class VolumeExistsError(ConfigError):
    """A volume of that name exists already (on this node, or through Ray on any)."""


class SandboxExistsError(ConfigError):
    """A live sandbox of that name exists already (names are unique in the cluster)."""


class VolumeNotFoundError(SandboxNotFoundError):
    """No volume with this name on the node."""


class VolumeInUseError(SandboxStateError):
    """The volume is mounted (by a sandbox, or held by a mount still going away) and the
    operation needs it idle, or it is mounted read-write elsewhere."""


class HostRetiringError(SandboxStateError):
    """The node's host is retiring (idle); the call can go to a fresh host."""


class ResumeError(SandboxStateError):
    """A suspended sandbox could not be resumed (runsc restore or its agent failed); its
    checkpoint stays on disk and the next call into it tries again."""


class SessionError(SandboxError):
    """An MCP call named an unknown session, or the server is at its session limit."""


class ModalError(SandboxError):
    """Modal's ``modal.exception.Error``: root of what ``ray_sandbox.modal`` raises itself."""


class ModalInvalidError(ModalError, ConfigError):
    """Modal's ``InvalidError``: a call Modal would refuse (e.g. ``returncode`` before
    ``wait()``)."""


class ModalNotFoundError(ModalError, SandboxNotFoundError):
    """Modal's ``NotFoundError``: no sandbox with this id or name."""

    __str__ = SandboxError.__str__


class ModalSandboxTerminatedError(ModalError):
    """Modal's ``SandboxTerminatedError``: ``wait()`` on a sandbox that was terminated."""


class ModalTimeoutError(ModalError, TimeoutError):
    """Modal's ``TimeoutError``."""

    __str__ = SandboxError.__str__


class ModalSandboxTimeoutError(ModalTimeoutError):
    """Modal's ``SandboxTimeoutError``: ``wait()`` on a sandbox whose ``timeout`` ran out."""


class ModalExecTimeoutError(ModalTimeoutError):
    """Modal's ``ExecTimeoutError``."""


class ModalConflictError(ModalInvalidError):
    """Modal's ``ConflictError``: the sandbox's state does not allow the call (e.g.
    ``wait_until_ready`` without a readiness probe, or after the sandbox ended)."""


class ModalAlreadyExistsError(ModalError, SandboxExistsError):
    """Modal's ``AlreadyExistsError``: ``Sandbox.create(name=)`` of a name a live sandbox
    has."""


class ModalClientClosed(ModalError):
    """Modal's ``ClientClosed``."""


class ModalRemoteError(ModalError):
    """Modal's ``RemoteError``: something failed on the far side (a build, a command)."""


class ModalImageBuildError(ModalRemoteError, ImageBuildError):
    """Modal's ``ImageBuildError``: building an image from Modal's DSL failed (``step``,
    ``log_tail`` as for :class:`ImageBuildError`)."""


class ModalSandboxFilesystemError(ModalError, SandboxFileError):
    """Modal's ``SandboxFilesystemError``: a ``sb.filesystem`` call failed."""


class ModalSandboxFilesystemNotFoundError(ModalSandboxFilesystemError,
                                          SandboxFileNotFoundError):
    """Modal's ``SandboxFilesystemNotFoundError``."""


class ModalSandboxFilesystemIsADirectoryError(ModalSandboxFilesystemError,
                                              SandboxIsADirectoryError):
    """Modal's ``SandboxFilesystemIsADirectoryError``."""


class ModalSandboxFilesystemNotADirectoryError(ModalSandboxFilesystemError,
                                               SandboxNotADirectoryError):
    """Modal's ``SandboxFilesystemNotADirectoryError``."""


class ModalSandboxFilesystemPathAlreadyExistsError(ModalSandboxFilesystemError,
                                                   SandboxFileExistsError):
    """Modal's ``SandboxFilesystemPathAlreadyExistsError``."""


class ModalSandboxFilesystemPermissionError(ModalSandboxFilesystemError,
                                            SandboxPermissionError):
    """Modal's ``SandboxFilesystemPermissionError``."""


class ModalSandboxFilesystemFileTooLargeError(ModalSandboxFilesystemError, FileTooLargeError):
    """Modal's ``SandboxFilesystemFileTooLargeError``."""


class ModalSandboxFilesystemDirectoryNotEmptyError(ModalSandboxFilesystemError):
    """Modal's ``SandboxFilesystemDirectoryNotEmptyError``: a non-recursive remove of a
    directory that has entries."""


# Modal's other names, for ``except`` clauses of code written for Modal: the facade never
# raises them (what they name is Modal's platform: functions, workspaces, its RPCs).
class ModalFunctionTimeoutError(ModalTimeoutError):
    """Modal's ``FunctionTimeoutError``."""


class ModalMountUploadTimeoutError(ModalTimeoutError):
    """Modal's ``MountUploadTimeoutError``."""


class ModalVolumeUploadTimeoutError(ModalTimeoutError):
    """Modal's ``VolumeUploadTimeoutError``."""


class ModalInteractiveTimeoutError(ModalTimeoutError):
    """Modal's ``InteractiveTimeoutError``."""


class ModalOutputExpiredError(ModalTimeoutError):
    """Modal's ``OutputExpiredError``."""


class ModalAuthError(ModalError):
    """Modal's ``AuthError``."""


class ModalConnectionError(ModalError):
    """Modal's ``ConnectionError`` (not the builtin's subclass, as in Modal)."""


class ModalDataLossError(ModalError):
    """Modal's ``DataLossError``."""


class ModalDeserializationError(ModalError):
    """Modal's ``DeserializationError``."""


class ModalExecutionError(ModalError):
    """Modal's ``ExecutionError``."""


class ModalInternalError(ModalError):
    """Modal's ``InternalError``."""


class ModalInternalFailure(ModalError):
    """Modal's ``InternalFailure``."""


class ModalLogsFetchError(ModalError):
    """Modal's ``LogsFetchError``."""


class ModalPermissionDeniedError(ModalError):
    """Modal's ``PermissionDeniedError``."""


class ModalRequestSizeError(ModalError):
    """Modal's ``RequestSizeError``."""


class ModalResourceExhaustedError(ModalError):
    """Modal's ``ResourceExhaustedError``."""


class ModalSerializationError(ModalError):
    """Modal's ``SerializationError``."""


class ModalServiceError(ModalError):
    """Modal's ``ServiceError``."""


class ModalSnapshotCreationError(ModalError):
    """Modal's ``SnapshotCreationError``."""


class ModalUnimplementedError(ModalError):
    """Modal's ``UnimplementedError``."""


class ModalVersionError(ModalError):
    """Modal's ``VersionError``."""


class ModalWorkspaceManagementError(ModalError):
    """Modal's ``WorkspaceManagementError``."""


class ModalInputCancellation(BaseException):
    """Modal's ``InputCancellation`` (a BaseException, as in Modal)."""


class ModalModuleNotMountable(Exception):
    """Modal's ``ModuleNotMountable``."""


class ModalUserCodeException(Exception):
    """Modal's ``UserCodeException``."""


class ModalAsyncUsageWarning(UserWarning):
    """Modal's ``AsyncUsageWarning``."""


class ModalDeprecationError(UserWarning):
    """Modal's ``DeprecationError`` (a warning, as in Modal)."""


class ModalInternalAPIWarning(UserWarning):
    """Modal's ``InternalAPIWarning``."""


class ModalServerWarning(UserWarning):
    """Modal's ``ServerWarning``."""


class ProtocolError(ValueError):
    """The agent sent something the wire protocol does not allow (internal: see above)."""


class ProxyRefusal(Exception):
    """A request the egress proxy refuses (internal: see above): the HTTP status, its
    reason phrase and the message the sandbox reads in the response body."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


# Reprs and tracebacks name the public home of every error, not this private module.
for _name in __all__:
    globals()[_name].__module__ = "ray_sandbox"

# Modal's names, where Modal code imports them from (and pickle finds them).
MODAL_NAMES = {
    cls: cls.__name__.removeprefix("Modal") for cls in (
        ModalError, ModalInvalidError, ModalNotFoundError, ModalSandboxTerminatedError,
        ModalTimeoutError, ModalSandboxTimeoutError, ModalExecTimeoutError, ModalConflictError,
        ModalAlreadyExistsError, ModalClientClosed, ModalRemoteError, ModalImageBuildError,
        ModalSandboxFilesystemError, ModalSandboxFilesystemNotFoundError,
        ModalSandboxFilesystemIsADirectoryError, ModalSandboxFilesystemNotADirectoryError,
        ModalSandboxFilesystemPathAlreadyExistsError, ModalSandboxFilesystemPermissionError,
        ModalSandboxFilesystemFileTooLargeError, ModalSandboxFilesystemDirectoryNotEmptyError,
        ModalFunctionTimeoutError, ModalMountUploadTimeoutError, ModalVolumeUploadTimeoutError,
        ModalInteractiveTimeoutError, ModalOutputExpiredError, ModalAuthError,
        ModalConnectionError, ModalDataLossError, ModalDeserializationError,
        ModalExecutionError, ModalInternalError, ModalInternalFailure, ModalLogsFetchError,
        ModalPermissionDeniedError, ModalRequestSizeError, ModalResourceExhaustedError,
        ModalSerializationError, ModalServiceError, ModalSnapshotCreationError,
        ModalUnimplementedError, ModalVersionError, ModalWorkspaceManagementError,
        ModalInputCancellation, ModalModuleNotMountable, ModalUserCodeException,
        ModalAsyncUsageWarning, ModalDeprecationError, ModalInternalAPIWarning,
        ModalServerWarning,
    )
}
for _cls, _name in MODAL_NAMES.items():
    _cls.__module__ = "ray_sandbox.modal.exception"
    _cls.__name__ = _cls.__qualname__ = _name
