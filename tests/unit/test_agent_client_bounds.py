"""The host client against a hostile agent: a fake server speaking the wire protocol over a
unix socket. Code running as root in a sandbox can put exactly such a server where the agent
listens, so every bound here is the client's own, whatever the agent claims."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest

from ray_sandbox.runtime import errors
from ray_sandbox.runtime.agent import AgentClient
from ray_sandbox.runtime.agent import protocol as p

MiB = 1 << 20
# Hostile replies stop after this many 1 MiB frames, so that a client without bounds fails
# the test (it got too much) instead of exhausting the machine's memory.
FLOOD_FRAMES = 80


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("client hung up")
        buf += got
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    length, ftype = p.HEADER.unpack(recv_exact(sock, p.HEADER.size))
    return ftype, recv_exact(sock, length)


def send(sock: socket.socket, ftype: int, payload: bytes = b"") -> None:
    sock.sendall(p.HEADER.pack(len(payload), ftype) + payload)


def recv_request(sock: socket.socket) -> int:
    """The request's type, after the client's stream frames (stdin, upload) up to CLOSE."""
    op, _ = recv_frame(sock)
    if op in (p.Op.EXEC, p.Op.WRITE):
        while recv_frame(sock)[0] != p.Stream.CLOSE:
            pass
    return op


STARTED = p.encode_fields([(p.Tag.PID, 7)])
EXIT0 = p.encode_fields([(p.Tag.EXIT_CODE, 0)])


class FakeAgent:
    """Serves each connection with ``handler(sock)``; counts connections and how many
    flood frames the handlers got out before the client hung up."""

    def __init__(self, handler: Callable[[FakeAgent, socket.socket], None]) -> None:
        self.dir = tempfile.mkdtemp(prefix="rsbf")
        self.path = os.path.join(self.dir, "agent.sock")
        self.handler = handler
        self.connections = 0
        self.sent = 0
        self.stop = threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(8)
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            self.socks.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        with sock, contextlib.suppress(OSError):
            self.handler(self, sock)

    def flood(self, sock: socket.socket, ftype: int, payload: bytes, frames: int) -> None:
        raw = p.HEADER.pack(len(payload), ftype) + payload
        for _ in range(frames):
            sock.sendall(raw)
            self.sent += 1

    def client(self, **kw) -> AgentClient:
        return AgentClient(self.path, sandbox_id="fake", **kw)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.acceptor.join()
        for sock in self.socks:  # a client left open keeps a handler waiting
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            thread.join()
        os.unlink(self.path)
        os.rmdir(self.dir)


@pytest.fixture
def fake() -> Iterator[Callable[[Callable], FakeAgent]]:
    made: list[FakeAgent] = []

    def make(handler: Callable[[FakeAgent, socket.socket], None]) -> FakeAgent:
        made.append(FakeAgent(handler))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


def honest(agent: FakeAgent, sock: socket.socket) -> None:
    """Answers like a real agent: ping, an exec that prints nothing, OK to the rest."""
    while True:
        op = recv_request(sock)
        if op == p.Op.PING:
            send(sock, p.Reply.OK, p.encode_fields([(p.Tag.VERSION, b"fake")]))
        elif op == p.Op.EXEC:
            send(sock, p.Reply.STARTED, STARTED)
            send(sock, p.Reply.EXIT, EXIT0)
        else:
            send(sock, p.Reply.OK)


# -- finding 3: the client enforces the output limit and caps every reply -----------------


@pytest.mark.parametrize("stream", [p.Reply.STDOUT, p.Reply.STDERR])
def test_endless_output_is_truncated_at_max_output_bytes_by_the_client(fake, stream):
    def flood(agent, sock):
        recv_request(sock)
        send(sock, p.Reply.STARTED, STARTED)
        agent.flood(sock, stream, bytes(MiB), FLOOD_FRAMES)
        send(sock, p.Reply.EXIT, EXIT0)

    agent = fake(flood)
    r = agent.client().exec(["yes"], max_output_bytes=MiB)
    got = r.stdout_bytes if stream == p.Reply.STDOUT else r.stderr_bytes
    assert len(got) == MiB and r.truncated
    # The client stopped there: it dropped the connection (the agent kills the command).
    assert (r.exit_code, r.signal) == (137, 9)
    for thread in agent.threads:
        thread.join()
    assert agent.sent < FLOOD_FRAMES


def test_exec_stream_never_yields_more_than_max_output_bytes(fake):
    def flood(agent, sock):
        recv_request(sock)
        send(sock, p.Reply.STARTED, STARTED)
        agent.flood(sock, p.Reply.STDOUT, bytes(MiB - 1), FLOOD_FRAMES)
        send(sock, p.Reply.EXIT, EXIT0)

    items = list(fake(flood).client().exec_stream(["yes"], max_output_bytes=3 * MiB))
    assert sum(len(i.data) for i in items[:-1]) == 3 * MiB
    assert items[-1].truncated


def bad_exec_reply(*frames: tuple[int, bytes]) -> Callable:
    def handler(agent, sock):
        recv_request(sock)
        for ftype, payload in frames:
            send(sock, ftype, payload)
        # A client that accepted all that would wait here for the EXIT: give it one.
        send(sock, p.Reply.EXIT, EXIT0)

    return handler


@pytest.mark.parametrize(
    "frames",
    [
        [(p.Reply.STARTED, STARTED), (p.Reply.STARTED, STARTED)],  # a second STARTED
        [(p.Reply.STDOUT, b"x")],  # output before STARTED
        [(p.Reply.STARTED, STARTED), (p.Reply.STDOUT, b"")],  # empty frames never end
        [(p.Reply.STARTED, STARTED), (p.Reply.OK, b"")],  # not part of an exec reply
        # an EXIT padded to 1 MiB with unknown tags (control frames are small)
        [(p.Reply.STARTED, STARTED),
         (p.Reply.EXIT, EXIT0 + p.encode_fields([(99, bytes(MiB - 64))]))],
    ],
    ids=["started-twice", "output-first", "empty-frame", "ok-in-exec", "huge-exit"],
)
def test_exec_protocol_violations_are_agent_protocol_errors(fake, frames):
    client = fake(bad_exec_reply(*frames)).client()
    with pytest.raises(errors.AgentProtocolError) as info:
        client.exec(["true"])
    assert info.value.sandbox_id == "fake"


def test_endless_empty_output_frames_do_not_spin_forever(fake):
    def spin(agent, sock):
        recv_request(sock)
        send(sock, p.Reply.STARTED, STARTED)
        agent.flood(sock, p.Reply.STDOUT, b"", 1 << 20)
        send(sock, p.Reply.EXIT, EXIT0)

    with pytest.raises(errors.AgentProtocolError):
        fake(spin).client().exec(["true"])


def entry(path: bytes) -> bytes:
    return p.encode_fields([(p.Tag.PATH, path), (p.Tag.TYPE, 1), (p.Tag.SIZE, 0),
                            (p.Tag.MODE, 0o644), (p.Tag.UID, 0), (p.Tag.GID, 0),
                            (p.Tag.MTIME_NS, 0)])  # fmt: skip


def test_listing_entries_of_a_megabyte_are_protocol_errors(fake):
    def huge(agent, sock):
        recv_request(sock)
        agent.flood(sock, p.Reply.ENTRY, entry(b"n" * (MiB - 100)), FLOOD_FRAMES)
        send(sock, p.Reply.OK)

    with pytest.raises(errors.AgentProtocolError):
        fake(huge).client().list_dir("/")


def test_endless_listing_stops_at_max_entries(fake):
    def endless(agent, sock):
        recv_request(sock)
        agent.flood(sock, p.Reply.ENTRY, entry(b"f"), 100_000)
        send(sock, p.Reply.OK)

    client = fake(endless).client()
    with pytest.raises(errors.SandboxFileError, match="max_entries=1000") as info:
        client.list_dir("/", max_entries=1000)
    assert info.value.sandbox_id == "fake"
    with pytest.raises(errors.SandboxFileError, match="max_entries=10"):
        list(client.walk("/", max_entries=10))


def test_a_violation_breaks_only_that_connection(fake):
    """After a protocol error the pooled connection is gone; the next call starts afresh."""
    def first_bad(agent, sock):
        if agent.connections == 1:
            recv_request(sock)
            send(sock, p.Reply.STDOUT, b"x")  # not an answer to ping
            sock.recv(1)  # until the client hangs up
        else:
            honest(agent, sock)

    agent = fake(first_bad)
    client = agent.client()
    with pytest.raises(errors.AgentProtocolError):
        client.ping()
    assert client.ping() == "fake"
    assert agent.connections == 2


# -- finding 14 (client): reads are bounded by max_bytes ---------------------------------


FILE_FRAMES = FLOOD_FRAMES * 4  # of the default chunk, 256 KiB: 80 MiB in all


def endless_file() -> Callable:
    def handler(agent, sock):
        recv_request(sock)
        agent.flood(sock, p.Stream.DATA, bytes(256 * 1024), FILE_FRAMES)
        send(sock, p.Reply.OK)

    return handler


def test_read_file_defaults_to_a_64_mib_bound(fake):
    with pytest.raises(errors.FileTooLargeError, match="max_bytes") as info:
        fake(endless_file()).client().read_file("/sparse")
    assert info.value.sandbox_id == "fake"


def test_read_file_and_iter_read_stop_at_max_bytes(fake):
    agent = fake(endless_file())
    client = agent.client()
    with pytest.raises(errors.FileTooLargeError):
        client.read_file("/sparse", max_bytes=4 * MiB)
    got = 0
    with pytest.raises(errors.FileTooLargeError):
        for chunk in client.iter_read("/sparse", max_bytes=3 * MiB + 5):
            got += len(chunk)
    assert got <= 3 * MiB + 5
    for thread in agent.threads:
        thread.join()
    assert agent.sent < 2 * FILE_FRAMES  # both reads hung up early


def test_read_file_at_exactly_max_bytes_is_fine(fake):
    def file(agent, sock):
        recv_request(sock)
        agent.flood(sock, p.Stream.DATA, b"x" * 1000, 3)
        send(sock, p.Reply.OK)

    assert fake(file).client().read_file("/f", max_bytes=3000) == b"x" * 3000


@pytest.mark.parametrize(
    ("kwargs", "sent"),
    [({"chunk_size": 1024}, 1025),  # a frame bigger than the chunk asked for
     ({"length": 10}, 11),  # more than the length asked for
     ({}, 0)],  # an empty data frame
)
def test_read_replies_beyond_the_request_are_protocol_errors(fake, kwargs, sent):
    def file(agent, sock):
        recv_request(sock)
        send(sock, p.Stream.DATA, bytes(sent))
        send(sock, p.Reply.OK)

    with pytest.raises(errors.AgentProtocolError):
        list(fake(file).client().iter_read("/f", **kwargs))


# -- finding 10: every send and receive has a deadline ------------------------------------


def stopped(agent, sock):
    """A handler frozen with SIGSTOP: reads nothing, answers nothing."""
    agent.stop.wait()


def frozen_after_first_connection(agent, sock):
    if agent.connections == 1:
        stopped(agent, sock)
    else:
        honest(agent, sock)


@pytest.mark.timeout(60)
def test_upload_to_a_frozen_agent_times_out_and_drops_the_connection(fake):
    agent = fake(frozen_after_first_connection)
    client = agent.client(io_timeout=0.5)
    with pytest.raises(errors.AgentTimeoutError) as info:
        client.write_file("/big", bytes(64 * MiB))
    assert info.value.sandbox_id == "fake"
    assert isinstance(info.value, errors.SandboxDiedError | TimeoutError)
    assert client.ping() == "fake" and agent.connections == 2


@pytest.mark.timeout(60)
def test_a_reply_that_never_comes_times_out(fake):
    client = fake(frozen_after_first_connection).client(io_timeout=0.5)
    with pytest.raises(errors.AgentTimeoutError):
        client.stat("/x")
    assert client.ping() == "fake"


@pytest.mark.timeout(60)
def test_exec_stdin_to_a_frozen_agent_ends_at_the_exec_deadline(fake):
    client = fake(stopped).client(hung_margin=0.5)
    with pytest.raises(errors.AgentTimeoutError):
        client.exec(["cat"], stdin=bytes(64 * MiB), timeout=0.5)


@pytest.mark.parametrize("bad", [0, -1, "5", float("nan")])
def test_io_timeout_is_checked(bad):
    with pytest.raises(errors.ConfigError, match="io_timeout"):
        AgentClient("/nonexistent/agent.sock", io_timeout=bad)


# -- finding 16: bad arguments are ConfigErrors naming the argument -----------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"timeout": 1e10}, "timeout"),
        ({"timeout": 1e17}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"max_output_bytes": 2**63}, "max_output_bytes"),
        ({"max_output_bytes": 1.5}, "max_output_bytes"),
        ({"max_output_bytes": "1"}, "max_output_bytes"),
        ({"env": ["A=1", 5]}, "environment"),
        ({"env": [None]}, "environment"),
        ({"env": "A=1"}, "env"),
        ({"argv": None}, "argv"),
        ({"argv": 5}, "argv"),
        ({"argv": [5]}, "argument"),
        ({"cwd": 5}, "cwd"),
        ({"user": 5}, "user"),
        ({"stdin": 5}, "stdin"),
        ({"stdin": "text"}, "stdin"),
    ],
)
def test_bad_exec_arguments_are_config_errors(fake, kwargs, name):
    client = fake(honest).client()
    args = {"argv": ["true"], **kwargs}
    argv = args.pop("argv")
    with pytest.raises(errors.ConfigError, match=name) as info:
        client.exec(argv, **args)
    assert info.value.sandbox_id == "fake"
    with pytest.raises(errors.ConfigError, match=name):
        client.exec_stream(argv, **args)  # checked when called, not when iterated


@pytest.mark.parametrize("pty", ["big", (24,), (24, "80"), (1.5, 80), (0, 80), (24, 70000)])
def test_bad_pty_sizes_are_config_errors(fake, pty):
    with pytest.raises(errors.ConfigError, match="pty"):
        fake(honest).client().spawn(["sh"], pty=pty)


@pytest.mark.parametrize("data", [5, "text", None, [b"ok", 5]])
def test_bad_upload_data_is_a_config_error(fake, data):
    client = fake(honest).client()
    with pytest.raises(errors.ConfigError, match="data"):
        client.write_file("/f", data)
    assert client.ping() == "fake"  # nothing half-sent is left on a pooled connection


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda c: c.write_file("/f", b"", mode="644"), "mode"),
        (lambda c: list(c.iter_read("/f", offset=-1)), "offset"),
        (lambda c: list(c.iter_read("/f", length=2**64)), "length"),
        (lambda c: list(c.iter_read("/f", chunk_size="big")), "chunk_size"),
        (lambda c: c.read_file("/f", max_bytes=-1), "max_bytes"),
        (lambda c: c.chmod("/f", None), "mode"),
        (lambda c: c.mkdir("/d", mode=1.5), "mode"),
    ],
)
def test_bad_file_arguments_are_config_errors(fake, call, name):
    with pytest.raises(errors.ConfigError, match=name):
        call(fake(honest).client())
