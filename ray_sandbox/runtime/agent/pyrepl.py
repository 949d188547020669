"""Warm Python: a persistent interpreter inside the sandbox, driven over its stdin/stdout.

The driver below runs as ``python3 -u -c <driver>`` through :meth:`AgentClient.spawn`. It
moves its protocol pipes to private descriptors, points fd 0 at /dev/null and, for every
request, points fds 1 and 2 at two memfds, so output of the code (including subprocesses and
C extensions writing to the fds) is captured. A request is ``u32 length + JSON {code, max}``;
a reply is ``u32 length + JSON {value, exception, out, err, truncated}`` followed by ``out``
bytes of stdout and ``err`` bytes of stderr.
"""

from __future__ import annotations

import json
import signal
import struct
import threading
import time
from typing import Any

from ..errors import SandboxStateError
from ..results import ExecResult
from .client import DEFAULT_MAX_OUTPUT, AgentClient, AgentProcess

_LEN = struct.Struct(">I")
_INTERRUPT_GRACE_S = 2.0  # how long timed-out code gets to hand back its output

DRIVER = r"""
import ast, json, os, struct, sys, traceback

def _capture_file(name):
    try:
        return os.memfd_create(name)
    except (AttributeError, OSError):
        import tempfile
        with tempfile.TemporaryFile() as f:
            return os.dup(f.fileno())

def _main():
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, err = _capture_file("stdout"), _capture_file("stderr")
    ns = {"__name__": "__main__", "__builtins__": __builtins__}

    def readn(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(rfd, n - len(buf))
            if not chunk:
                os._exit(0)
            buf += chunk
        return buf

    while True:
        req = json.loads(readn(struct.unpack(">I", readn(4))[0]))
        cap = req["max"]
        for fd in (out, err):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        value = exc = None
        try:
            tree = ast.parse(req["code"], "<cell>", "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), ns)
            if last is not None:
                result = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
                if result is not None:
                    value = repr(result)[:cap]
        except BaseException as e:
            tb = e.__traceback__.tb_next if e.__traceback__ else None
            exc = "".join(traceback.format_exception(type(e), e, tb))
            sys.stderr.write(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        o, r = os.pread(out, cap + 1, 0), os.pread(err, cap + 1, 0)
        trunc = len(o) > cap or len(r) > cap
        o, r = o[:cap], r[:cap]
        head = json.dumps({"value": value, "exception": exc, "out": len(o), "err": len(r),
                           "truncated": trunc}).encode()
        msg = memoryview(struct.pack(">I", len(head)) + head + o + r)
        while msg:
            msg = msg[os.write(wfd, msg):]

_main()
"""


class PythonResult(ExecResult):
    """One :meth:`PythonContext.run`: ``exit_code`` 0, or 1 when the code raised (the
    traceback is in ``exception`` and on stderr); ``value`` is the repr of a trailing
    expression. When the interpreter died or timed out, the fields describe its process."""

    value: str | None = None
    exception: str | None = None


class PythonContext:
    """One persistent interpreter (state kept between runs). Separate contexts are separate
    interpreters. A timeout or crash kills the interpreter; the next run starts a fresh one,
    so state is then reset. A timed-out run still returns what the code printed."""

    def __init__(
        self,
        client: AgentClient,
        *,
        python: str = "python3",
        env: list[str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT,
    ) -> None:
        self._client = client
        self._argv = [python, "-u", "-c", DRIVER]
        self._env, self._cwd, self._user = env, cwd, user
        self._max = max_output_bytes
        self._proc: AgentProcess | None = None
        self._buf = bytearray()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _process(self) -> AgentProcess:
        if self._proc is not None and self._proc.done:
            self._stop()
        if self._proc is None:
            self._buf.clear()
            self._proc = self._client.spawn(
                self._argv, env=self._env, cwd=self._cwd, user=self._user,
                max_buffer_bytes=3 * self._max + (1 << 20), keeps_active=False,
            )  # fmt: skip
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def run(self, code: str, timeout: float | None = None) -> PythonResult:
        """Runs ``code`` in the context's namespace."""
        with self._lock:
            start = time.monotonic()
            proc = self._process()
            proc.keeps_active = True  # the sandbox is in use while code runs, not between
            try:
                return self._run(proc, code, timeout, start)
            finally:
                proc.keeps_active = False
                self._client.pool.touch()

    def _run(self, proc: AgentProcess, code: str, timeout: float | None,
             start: float) -> PythonResult:
        req = json.dumps({"code": code, "max": self._max}).encode()
        try:
            proc.write_stdin(_LEN.pack(len(req)) + req)
        except SandboxStateError:  # it died before reading (e.g. python3 not found)
            reply = None
        else:
            reply = self._reply(proc, start + timeout if timeout is not None else None)
        elapsed = time.monotonic() - start
        if reply is not None:
            head, out, err = reply
            return PythonResult(
                exit_code=1 if head["exception"] else 0,
                stdout_bytes=out,
                stderr_bytes=err,
                duration_seconds=elapsed,
                truncated=head["truncated"],
                value=head["value"],
                exception=head["exception"],
            )
        timed_out = not proc.done
        printed = self._interrupt(proc) if timed_out else None
        proc.kill()
        died = proc.wait(timeout=5.0) or ExecResult(exit_code=137, signal=9)
        self._stop()
        out, err = printed or (died.stdout_bytes, died.stderr_bytes)
        return PythonResult(
            exit_code=died.exit_code,
            signal=died.signal,
            stdout_bytes=out,
            stderr_bytes=err,
            duration_seconds=elapsed,
            timed_out=timed_out,
        )

    def _interrupt(self, proc: AgentProcess) -> tuple[bytes, bytes] | None:
        """What the timed-out code printed: SIGINT raises KeyboardInterrupt in it, and the
        driver replies with its captured output as after any exception (the traceback it
        adds is dropped). None if no reply comes within ``_INTERRUPT_GRACE_S`` (the code
        ignored the signal, or it arrived between requests)."""
        proc.kill(signal.SIGINT)
        reply = self._reply(proc, time.monotonic() + _INTERRUPT_GRACE_S)
        if reply is None:
            return None
        head, out, err = reply
        tb = (head["exception"] or "").encode()
        return out, err[: -len(tb)] if tb and err.endswith(tb) else err

    def _reply(
        self, proc: AgentProcess, deadline: float | None
    ) -> tuple[dict[str, Any], bytes, bytes] | None:
        """The next reply, or None if the deadline passed or the interpreter died."""
        while (reply := self._parse()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            data = proc.read(timeout=left)
            if not data and proc.done:
                return None
            self._buf += data
        return reply

    def _parse(self) -> tuple[dict[str, Any], bytes, bytes] | None:
        if len(self._buf) < _LEN.size:
            return None
        (hlen,) = _LEN.unpack_from(self._buf)
        if len(self._buf) < _LEN.size + hlen:
            return None
        head = json.loads(self._buf[_LEN.size : _LEN.size + hlen])
        body = _LEN.size + hlen
        end = body + head["out"] + head["err"]
        if len(self._buf) < end:
            return None
        out = bytes(self._buf[body : body + head["out"]])
        err = bytes(self._buf[body + head["out"] : end])
        del self._buf[:end]
        return head, out, err

    def close(self) -> None:
        with self._lock:
            self._stop()

    def kill(self, timeout: float = 5.0) -> None:
        """Kill the interpreter and wait until it is gone (``close`` only drops the
        connection and leaves the killing to the agent, asynchronously)."""
        with self._lock:
            if self._proc is not None and not self._proc.done:
                self._proc.kill()
                self._proc.wait(timeout=timeout)
            self._stop()

    def __enter__(self) -> PythonContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
