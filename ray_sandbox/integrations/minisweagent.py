"""mini-swe-agent's ``Environment`` on a ray_sandbox sandbox.

Selected by import path, as mini-swe-agent takes any environment class
(``minisweagent/environments/__init__.py``, ``get_environment_class``)::

    environment:
      environment_class: ray_sandbox.integrations.minisweagent.RaySandboxEnvironment
      image: ray-sandbox/python
      cwd: /testbed
      timeout: 60

or ``mini --environment-class ray_sandbox.integrations.minisweagent.RaySandboxEnvironment``.

The contract followed is that of mini-swe-agent's own ``DockerEnvironment``
(``environments/docker.py``, 2.4.6): ``execute(action, cwd="", *, timeout=None)`` runs
``action["command"]`` through ``bash -lc`` in a fresh shell in ``cwd`` (the config's, else
``/``), with ``env`` and the host's ``forward_env`` variables, and returns ``{"output",
"returncode", "exception_info"}`` with stderr folded into ``output``. It never raises for a
failed command: a timeout or a transport failure is ``returncode: -1`` with
``exception_info`` and ``extra.exception_type``, as there; the one exception is
``Submitted``, raised when the output's first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
and the command succeeded (the environment detects submission in mini-swe-agent).

Beyond the built-in environments: ``user``, ``network``, a bound on output the host holds
(``max_output_bytes``; mini-swe-agent elides long output in its prompt template, not in the
environment), more sandbox options (``sandbox``), and :meth:`RaySandboxEnvironment.fork`,
which copies the running sandbox (processes, memory and files) into new environments, so an
agent's trajectory can branch at any step. ``cleanup()`` (also at ``__del__``) deletes it.
"""

from __future__ import annotations

import os
import platform
import threading
from typing import Any, Literal

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import ConfigDict, Field

from ..runtime.config import DEFAULT_IMAGE
from ..runtime.verbs import ExecRequest
from ._box import Box, Transport, make_config, merged_output

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class RaySandboxEnvironmentConfig(Transport):
    """The ``environment:`` keys of the environment (mini-swe-agent passes them as keyword
    arguments); those DockerEnvironment has mean what they mean there."""

    model_config = ConfigDict(extra="forbid")

    image: str = DEFAULT_IMAGE
    cwd: str = Field("/", description="where commands run unless execute(cwd=) says")
    env: dict[str, str] = Field(default_factory=dict)
    forward_env: list[str] = Field(
        default_factory=list, description="host variables passed in when set; env wins")
    timeout: int = Field(30, gt=0, description="seconds per command; the process tree is "
                         "killed at it")
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"], min_length=1)
    user: str | None = Field(None, description="'name', 'uid' or 'uid:gid'; None: the "
                             "image's USER")
    network: Literal["none", "public", "sandbox"] = Field(
        "none", description="'public' for pip/git in the task; the default has no network")
    cpu: float | None = Field(None, description="cores; None: ray_sandbox's default (1)")
    memory: str | int | None = Field(None, description="'2Gi' or bytes; None: ray_sandbox's "
                                     "default (512 MiB)")
    max_output_bytes: int = Field(
        10 * 2**20, gt=0, description="output kept per command; the rest is dropped and "
        "the result says so (extra.truncated)")
    sandbox: dict[str, Any] = Field(
        default_factory=dict, description="more SandboxConfig fields (disk, pids_limit, "
        "egress, labels, ...)")


class RaySandboxEnvironment:
    """A mini-swe-agent environment whose commands run in a gVisor sandbox."""

    def __init__(self, *, config_class: type = RaySandboxEnvironmentConfig,
                 _box: Box | None = None, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self._lock = threading.Lock()
        if _box is None:
            c = self.config
            cfg = make_config(c.sandbox, image=c.image, network=c.network, cpu=c.cpu,
                              memory=c.memory, timeout_seconds=float(c.timeout))
            _box = c.open(cfg)
        self._box: Box | None = _box

    @property
    def sandbox_id(self) -> str:
        return self._require().sandbox_id

    def _require(self) -> Box:
        if self._box is None:
            raise RuntimeError("the environment was cleaned up")
        return self._box

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None
                ) -> dict[str, Any]:
        command = action.get("command", "")
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        limit = timeout or self.config.timeout
        request = ExecRequest(
            command=merged_output(self.config.interpreter, command),
            cwd=cwd or self.config.cwd, env=env or None, user=self.config.user,
            timeout=float(limit), max_output_bytes=self.config.max_output_bytes)
        try:
            result = self._require().exec(request)
        except Exception as exc:  # noqa: BLE001 - reported in the output, as the built-ins do
            output = _failure("", exc)
        else:
            text = result.stdout
            if result.timed_out:
                output = _failure(text, TimeoutError(
                    f"Command {command!r} timed out after {limit} seconds"))
            else:
                output = {"output": text, "returncode": result.exit_code, "exception_info": ""}
            if result.truncated:
                output["output"] = text + (f"\n[output truncated: only the first "
                                           f"{self.config.max_output_bytes} bytes were kept]")
                output.setdefault("extra", {})["truncated"] = True
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__name__}",
        }}}

    def fork(self, k: int = 1) -> list[RaySandboxEnvironment]:
        """``k`` environments whose sandboxes are running copies of this one's (files,
        processes, memory), for branching a trajectory; each needs its own ``cleanup``."""
        return [type(self)(_box=b, **self.config.model_dump())
                for b in self._require().fork(k)]

    def cleanup(self) -> None:
        """Delete the sandbox (idempotent)."""
        with self._lock:
            box, self._box = getattr(self, "_box", None), None
        if box is not None:
            box.close()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the owner reaps it
            pass


def _failure(output: str, exc: BaseException) -> dict[str, Any]:
    """A failed execute, in the built-in environments' shape."""
    return {"output": output, "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}


__all__ = ["RaySandboxEnvironment", "RaySandboxEnvironmentConfig"]
