"""The verbs a sandbox answers, declared once: each one's typed request and how it travels.

A verb is a method of :class:`~ray_sandbox.runtime.SandboxRuntime` that takes a sandbox id and
one request (``rt.exec(sid, ExecRequest(...))``, or the same as keywords:
``rt.exec(sid, "ls", timeout=5)``). The layers above forward it without re-typing it, the way
gVisor passes one ``control.ExecArgs`` from ``runsc exec`` to the sandbox: the node's host
dispatches any row of :data:`VERBS` generically, the Ray handle builds ``sb.<verb>.remote``
from the row, and the HTTP service and its clients send the same request models. A new verb
costs its runtime method, a row here and (if HTTP should have it) one route.

Per row: the request model (its fields are the verb's options, with their defaults), whether
it streams (a generator of chunks, then the result), and the group of the host's threads it
runs in (``work``: as long as the sandbox's code wants; ``control``: short; docs/scale.md, "A
host's threads").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from .agent.client import READ_MAX
from .config import EgressPolicy
from .errors import ConfigError
from .exec_request import argv_of, env_of
from .records import SandboxRecord

Group = Literal["work", "control"]


class Request(BaseModel):
    """One call's options. ``POSITIONAL`` names the fields a caller may pass by position
    after the sandbox id (``exec(sid, "ls")``). Text may carry undecodable bytes as
    surrogates (``os.fsdecode``): the agent gets them back as bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True,
                              populate_by_name=True)
    POSITIONAL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def of(cls, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None, *,
           sandbox_id: str | None = None) -> Self:
        """The request a call's arguments make: an instance passed as is, else the fields
        from positions and keywords; a bad or unknown one is a ConfigError naming it (and
        ``sandbox_id``)."""
        if len(args) == 1 and isinstance(args[0], cls) and not kwargs:
            return args[0]
        if len(args) > len(cls.POSITIONAL):
            raise ConfigError(f"{cls.__name__} takes {len(cls.POSITIONAL)} positional "
                              f"argument(s) ({', '.join(cls.POSITIONAL) or 'none'}), got "
                              f"{len(args)}", sandbox_id=sandbox_id)
        try:
            return cls(**dict(zip(cls.POSITIONAL, args, strict=False)), **(kwargs or {}))
        except ValidationError as exc:
            msgs = []
            for e in exc.errors():
                loc = ".".join(str(p) for p in e["loc"]) or "request"
                what = "unknown option" if e["type"] == "extra_forbidden" else e["msg"]
                msgs.append(f"{loc}: {what}")
            raise ConfigError(f"invalid {cls.__name__}: {'; '.join(msgs)}",
                              sandbox_id=sandbox_id) from None


class NoRequest(Request):
    """A verb without options."""


class CommandRequest(Request):
    """What a command runs as; unset fields fall back to the sandbox's config, then the
    image's (:meth:`agent_args`)."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("command",)

    command: str | list[str] = Field(description="a string runs through the shell (``-c``); "
                                     "a list runs as argv")
    cwd: str | None = None
    env: dict[str, str] | None = None
    user: str | None = Field(None, description="'name', 'uid' or 'uid:gid'")
    shell: str | None = Field(None, description="the shell a string runs through")
    timeout: float | None = Field(
        None, strict=True,  # "5" is a caller's bug, not five seconds
        validation_alias=AliasChoices("timeout", "timeout_seconds"),
        serialization_alias="timeout_seconds",
        description="seconds; the whole process tree is killed at it (None: the sandbox's "
                    "timeout_seconds); over HTTP it is named timeout_seconds")

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        # argv items as text (``["sleep", 1]``), as subprocess would not but callers expect
        return [a if isinstance(a, str) else str(a) for a in v] \
            if isinstance(v, list | tuple) else v

    def agent_args(self, rec: SandboxRecord) -> dict[str, Any]:
        """The agent client's ``exec``/``spawn`` arguments for the sandbox of ``rec``."""
        cfg = rec.config
        return {
            "argv": argv_of(rec, self.command, self.shell),
            "env": env_of(rec, self.env),
            "cwd": self.cwd or cfg.get("workdir") or rec.image_workdir or "/",
            "user": self.user or cfg.get("user") or rec.image_user or None,
            "timeout": self.timeout if self.timeout is not None else cfg.get("timeout_seconds"),
        }


class ExecRequest(CommandRequest):
    """``exec`` and ``exec_stream``: run a command to its end."""

    stdin: bytes | str | None = None
    max_output_bytes: int | None = Field(None, gt=0, description="kept per stream; the rest "
                                         "is dropped and the result marked truncated")


class SpawnRequest(CommandRequest):
    """``spawn``: a background process (its ``timeout`` is its own, not the sandbox's)."""

    pty: tuple[int, int] | None = Field(None, description="(rows, cols) of a terminal")

    def agent_args(self, rec: SandboxRecord) -> dict[str, Any]:
        args = super().agent_args(rec)
        args["timeout"] = self.timeout
        return args


class PythonRequest(Request):
    """``run_python``: code in a warm interpreter kept per ``context``."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("code",)

    code: str
    timeout: float | None = None
    context: str = "default"


class PathRequest(Request):
    POSITIONAL: ClassVar[tuple[str, ...]] = ("path",)

    path: str


class ReadRequest(PathRequest):
    max_bytes: int | None = Field(READ_MAX, gt=0, description="past it FileTooLargeError, "
                                  "whatever the sandbox claims the size is; None: no bound")


class WriteRequest(PathRequest):
    POSITIONAL: ClassVar[tuple[str, ...]] = ("path", "data")

    data: Any = Field(description="str, bytes, an iterable of bytes or a binary file")
    mode: int = Field(0o644, ge=0, le=0o7777)
    append: bool = False


class StatRequest(PathRequest):
    follow_symlinks: bool = False


class MkdirRequest(PathRequest):
    parents: bool = True
    mode: int = Field(0o755, ge=0, le=0o7777)


class RemoveRequest(PathRequest):
    recursive: bool = False


class LinkRequest(Request):
    """``link``/``unlink``: TCP ``port`` of the sandbox ``to`` (an id)."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("to", "port")

    to: str
    port: int = Field(gt=0, lt=65536)


class EgressRequest(Request):
    POSITIONAL: ClassVar[tuple[str, ...]] = ("policy",)

    policy: EgressPolicy


@dataclass(frozen=True)
class Verb:
    """One row of the table."""

    name: str
    request: type[Request]
    streams: bool = False
    group: Group = "control"
    doc: str = ""  # one line: what it does and returns
    method: str = ""  # SandboxRuntime's method, if not named like the verb

    def __post_init__(self) -> None:
        if not self.method:
            object.__setattr__(self, "method", self.name)


VERBS: dict[str, Verb] = {v.name: v for v in (
    Verb("exec", ExecRequest, group="work", doc="run a command to its end -> ExecResult"),
    Verb("exec_stream", ExecRequest, streams=True, group="work",
         doc="run a command -> its OutputChunks as they come, then the ExecResult"),
    Verb("run_python", PythonRequest, group="work",
         doc="run code in a warm interpreter kept per context -> PythonResult"),
    Verb("spawn", SpawnRequest, group="work",
         doc="start a background process -> (process key, pid); drive it with process"),
    Verb("read_file", ReadRequest, group="work", doc="a file's bytes"),
    Verb("write_file", WriteRequest, group="work",
         doc="write (or append to) a file; missing parent directories are made"),
    Verb("stat", StatRequest, group="work", doc="-> FileInfo"),
    Verb("exists", PathRequest, group="work", doc="whether the path exists"),
    Verb("list_dir", PathRequest, group="work", doc="-> list[FileInfo]"),
    Verb("mkdir", MkdirRequest, group="work", doc="make a directory"),
    Verb("remove", RemoveRequest, group="work", doc="remove a file (or a tree, recursive=True)"),
    Verb("status", NoRequest, method="get_status", doc="-> SandboxStatus"),
    Verb("pause", NoRequest, doc="freeze every process; calls fail until resume"),
    Verb("resume", NoRequest, doc="thaw a paused sandbox"),
    Verb("set_egress", EgressRequest,
         doc="replace a public/sandbox network's egress policy while it runs"),
    Verb("link", LinkRequest,
         doc="let this sandbox open TCP connections to port of the sandbox to (one node, "
             "network='sandbox') -> SandboxLink"),
    Verb("unlink", LinkRequest, doc="close a link; its connections are cut"),
    Verb("links", NoRequest, doc="-> list[SandboxLink] to peers that still exist"),
)}


def verb(name: str) -> Verb:
    """The row of ``name``; an unknown name is a ConfigError (a caller's typo, or a name a
    remote caller made up)."""
    try:
        return VERBS[name]
    except KeyError:
        raise ConfigError(f"no verb {name!r}; the verbs are {', '.join(VERBS)}") from None


__all__ = ["VERBS", "CommandRequest", "EgressRequest", "ExecRequest",
           "LinkRequest", "MkdirRequest", "NoRequest", "PathRequest", "PythonRequest",
           "ReadRequest", "RemoveRequest", "Request", "SpawnRequest", "StatRequest", "Verb",
           "WriteRequest", "verb"]
