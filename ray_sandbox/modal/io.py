"""Modal's process and file handles over a sandbox handle: ``ContainerProcess`` (what
``exec`` returns) with ``StreamReader`` stdout/stderr and a ``StreamWriter`` stdin, and
``FileIO`` (what ``open`` returns). A process is one the handle spawned (``spawn`` and
``process``: stdin, output as it comes, wait, kill)."""

from __future__ import annotations

import codecs
import enum
import sys
import threading
from collections.abc import Iterator
from typing import Any

import ray

from ..actor.handle import SandboxHandle
from ..runtime.errors import ModalInvalidError
from ..runtime.results import ExecResult
from ._aio import aiter_in_thread, dual
from ._refuse import refused

_READ_WAIT_S = 0.5  # one read call waits this long for output before asking for the exit
_PENDING_MAX = 16 << 20  # per stream, read from the host and not yet taken by its reader
TIMED_OUT = -1  # Modal's exit code of an exec whose timeout ran out


class StreamType(enum.Enum):
    """Modal's choice for an exec's stdout/stderr: ``PIPE`` (read it), ``DEVNULL`` (drop
    it) or ``STDOUT`` (print it on this process's stdout as it comes)."""

    PIPE = "pipe"
    DEVNULL = "devnull"
    STDOUT = "stdout"


class Process:
    """A process spawned through ``handle``; its exec ``timeout`` kills it (exit code -1)
    in the sandbox's agent, whether or not anyone waits and whether or not this client
    lives."""

    def __init__(self, handle: SandboxHandle, command: list[str], *, cwd: str | None,
                 env: dict[str, str] | None, timeout: float | None) -> None:
        self._handle = handle
        self._key, self.pid = ray.get(handle.spawn.remote(command, cwd=cwd, env=env,
                                                           timeout=timeout))
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()  # one read from the host at a time
        self._result: ExecResult | None = None
        # output read from the host and not yet taken: [stdout, stderr]. Both come in one
        # read, so each stream's reader keeps the other's for it (bounded: a stream nobody
        # reads loses what is over _PENDING_MAX, never the other stream)
        self._pending = (bytearray(), bytearray())

    def _op(self, op: str, *args: Any) -> Any:
        return ray.get(self._handle.process.remote(self._key, op, *args))

    def _keep(self, out: bytes, err: bytes) -> None:
        for buf, data in zip(self._pending, (out, err), strict=True):
            buf += data[: max(_PENDING_MAX - len(buf), 0)]

    def _finished(self, result: ExecResult | None) -> ExecResult | None:
        if result is None:
            return None
        with self._lock:
            if self._result is None:
                self._result = result
                self._keep(result.stdout_bytes, result.stderr_bytes)  # the unread rest
                self._op("close")  # the host forgets it
            return self._result

    @property
    def returncode(self) -> int | None:
        if self._result is None:
            return None
        return TIMED_OUT if self._result.timed_out else self._result.exit_code

    # The result is set only under _pump_lock, after any output a read took was kept: a
    # reader that sees the process finished has all of its stream in _pending. Every hold of
    # the lock is one host call of at most _READ_WAIT_S, so readers, wait() and poll() take
    # turns (a wait holding it for long starved the readers and their output overflowed).
    def poll(self) -> int | None:
        with self._pump_lock:
            if self._result is None:
                self._finished(self._op("wait", 0))
        return self.returncode

    def wait(self) -> int:
        while self._result is None:
            self._pump(None)
        return self.returncode  # type: ignore[return-value]

    def _pump(self, which: int | None) -> None:
        """One read of both streams from the host (waiting up to _READ_WAIT_S), or the exit
        when there was nothing; none if stream ``which`` got output meanwhile."""
        with self._pump_lock:
            if self._result is not None:
                return
            if which is not None:
                with self._lock:
                    if self._pending[which]:  # another reader's read brought ours
                        return
            out, err = self._op("read_both", _READ_WAIT_S)
            if out or err:
                with self._lock:
                    self._keep(out, err)
            else:
                self._finished(self._op("wait", 0))

    def _chunks(self, which: int) -> Iterator[bytes]:
        """One stream (0 stdout, 1 stderr) as it arrives, until the process exited and all
        of it was taken."""
        while True:
            with self._lock:
                data = bytes(self._pending[which])
                self._pending[which].clear()
                done = self._result is not None
            if data:
                yield data
            elif done:
                return
            else:
                self._pump(which)

    def stdout_chunks(self) -> Iterator[bytes]:
        return self._chunks(0)

    def stderr_chunks(self) -> Iterator[bytes]:
        return self._chunks(1)

    def write(self, data: bytes) -> None:
        self._op("write_stdin", data)

    def close_stdin(self) -> None:
        self._op("close_stdin")

    def kill(self) -> None:
        if self._result is None:
            self._op("kill", 9)


class StreamReader:
    """An exec's stdout or stderr: ``read()`` all of it (waits for the exit), or iterate
    over it as it comes (chunks; lines with ``bufsize=1``); ``async for`` and
    ``read.aio()`` too."""

    def __init__(self, chunks: Iterator[bytes], *, text: bool, by_line: bool,
                 fd: int = 1) -> None:
        self._chunks = chunks
        self._fd = fd
        self._text = text
        self._by_line = by_line
        self._items: Iterator[Any] | None = None

    def _decoded(self) -> Iterator[Any]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending: Any = "" if self._text else b""
        newline = "\n" if self._text else b"\n"
        for chunk in self._chunks:
            part = decoder.decode(chunk) if self._text else chunk
            if not self._by_line:
                if part:
                    yield part
                continue
            pending += part
            *lines, pending = pending.split(newline)
            yield from (line + newline for line in lines)
        rest = decoder.decode(b"", final=True) if self._text else b""
        if pending + rest:
            yield pending + rest

    def __iter__(self) -> Iterator[Any]:
        if self._items is None:
            self._items = self._decoded()
        return self._items

    def __next__(self) -> Any:
        return next(iter(self))

    def __aiter__(self):
        return aiter_in_thread(self)

    @dual
    def read(self) -> Any:
        empty = "" if self._text else b""
        return empty.join(self)

    @property
    def file_descriptor(self) -> int:
        """1 for stdout, 2 for stderr (Modal's numbering)."""
        return self._fd

    def close(self) -> None:
        """Stop reading: what has not been taken is dropped."""
        self._items = iter(())

    async def aclose(self) -> None:
        self.close()


class StreamWriter:
    """An exec's stdin: ``write`` buffers, ``write_eof`` marks the end, ``drain`` sends."""

    def __init__(self, process: Process) -> None:
        self._process = process
        self._buffer = bytearray()
        self._eof = False
        self._eof_sent = False

    def write(self, data: bytes | bytearray | memoryview | str) -> None:
        if self._eof:
            raise ModalInvalidError("stdin was closed with write_eof()")
        self._buffer += data.encode() if isinstance(data, str) else bytes(data)

    def write_eof(self) -> None:
        self._eof = True

    @dual
    def drain(self) -> None:
        if self._buffer:
            data, self._buffer = bytes(self._buffer), bytearray()
            self._process.write(data)
        if self._eof and not self._eof_sent:
            self._eof_sent = True
            self._process.close_stdin()


class ContainerProcess:
    """What ``Sandbox.exec`` returns: ``stdout``, ``stderr``, ``stdin``, ``wait()``,
    ``poll()`` and, once waited for, ``returncode`` (-1 if its ``timeout`` ran out)."""

    def __init__(self, process: Process, *, stdout: StreamType, stderr: StreamType,
                 text: bool, bufsize: int) -> None:
        self._process = process
        self.stdin = StreamWriter(process)
        by_line = bufsize == 1
        streams = {1: (stdout, process.stdout_chunks), 2: (stderr, process.stderr_chunks)}
        readers = []
        for fd, (kind, chunks) in streams.items():
            if kind is StreamType.STDOUT:  # printed here as it comes, by a thread that ends
                threading.Thread(target=_print_stream, args=(chunks(),), daemon=True,
                                 name="modal-exec-stdout").start()  # with the process
            readers.append(StreamReader(chunks() if kind is StreamType.PIPE else iter(()),
                                        text=text, by_line=by_line, fd=fd))
        self.stdout, self.stderr = readers

    @property
    def returncode(self) -> int:
        code = self._process.returncode
        if code is None:
            raise ModalInvalidError("call wait() before reading returncode (or use poll())")
        return code

    @dual
    def wait(self) -> int:
        return self._process.wait()

    @dual
    def poll(self) -> int | None:
        return self._process.poll()

    attach = refused("ContainerProcess.attach", "no interactive terminal here; use "
                     "exec(...) and its stdin/stdout")


def _print_stream(chunks: Iterator[bytes]) -> None:
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    for chunk in chunks:
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()


_MODES = {"r": (True, False), "rb": (False, False), "w": (True, True), "wb": (False, True),
          "a": (True, True), "ab": (False, True)}  # mode -> (text, writes)


class FileIO:
    """A file in a sandbox, as ``Sandbox.open`` returns it: a read mode fetches the file at
    open; writes are buffered and sent at ``flush``/``close``."""

    def __init__(self, handle: SandboxHandle, path: str, mode: str = "r") -> None:
        if mode not in _MODES:
            raise NotImplementedError(f"open(mode={mode!r}): only {', '.join(_MODES)}")
        self._handle, self.path, self.mode = handle, path, mode
        self._text, self._writes = _MODES[mode]
        self._data = b""
        self._pos = 0
        self._pending = bytearray()
        self._append = mode.startswith("a")
        self.closed = False
        if not self._writes:
            self._data = ray.get(handle.read_file.remote(path))
        elif not self._append:
            ray.get(handle.write_file.remote(path, b""))  # "w" truncates at open
            self._append = True

    def _check(self, writing: bool) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if writing != self._writes:
            raise ModalInvalidError(f"file opened with mode {self.mode!r}")

    def _out(self, data: bytes) -> Any:
        return data.decode("utf-8", errors="replace") if self._text else data

    @dual
    def read(self, n: int | None = None) -> Any:
        self._check(False)
        end = len(self._data) if n is None or n < 0 else self._pos + n
        data, self._pos = self._data[self._pos:end], min(end, len(self._data))
        return self._out(data)

    @dual
    def readline(self) -> Any:
        self._check(False)
        nl = self._data.find(b"\n", self._pos)
        end = len(self._data) if nl < 0 else nl + 1
        data, self._pos = self._data[self._pos:end], end
        return self._out(data)

    @dual
    def readlines(self) -> list[Any]:
        return list(iter(self.readline, self._out(b"")))

    @dual
    def seek(self, offset: int, whence: int = 0) -> int:
        """Move in a file opened for reading (0: from the start, 1: from here, 2: from the
        end); writes always go to the end."""
        self._check(False)
        base = {0: 0, 1: self._pos, 2: len(self._data)}.get(whence)
        if base is None:
            raise ValueError(f"whence must be 0, 1 or 2, not {whence!r}")
        self._pos = max(0, min(base + offset, len(self._data)))
        return self._pos

    @dual
    def write(self, data: bytes | str) -> None:
        self._check(True)
        if isinstance(data, str) != self._text:
            raise TypeError(f"write() needs {'str' if self._text else 'bytes'} in mode "
                            f"{self.mode!r}")
        self._pending += data.encode() if isinstance(data, str) else data

    @dual
    def flush(self) -> None:
        if self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            ray.get(self._handle.write_file.remote(self.path, data, append=self._append))

    @dual
    def close(self) -> None:
        if not self.closed:
            if self._writes:
                self.flush()
            self.closed = True

    def __enter__(self) -> FileIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
