"""What the egress proxy (``inject.py``) reads off the wire before it decides anything: the
server name of a TLS ClientHello, HTTP/1.1 request and response heads and their body framing
(ambiguous framing is refused, as request smuggling starts there), the masking of secret values
in a response stream, and the heads it writes. Pure functions over bytes the sandbox or an
upstream sent, each bounded by what it is given; no I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ..errors import ProxyRefusal

MASK_MIN = 4  # shorter secret values are not masked in responses (they would mangle text)
_METHOD_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32}$")
_TOKEN_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,256}$")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST_RE = re.compile(rf"^({_LABEL}\.)*{_LABEL}$")


# --- TLS ClientHello ---------------------------------------------------------------------------


def client_hello_sni(buf: bytes) -> tuple[bool, str | None]:
    """(whether ``buf`` holds the whole first TLS record, the server name in it). ValueError
    if ``buf`` does not start a TLS ClientHello."""
    if len(buf) < 5:
        return False, None
    if buf[0] != 22 or buf[1] != 3:
        raise ValueError("not a TLS handshake record")
    n = int.from_bytes(buf[3:5], "big")
    if not 4 <= n <= 16384:
        raise ValueError("bad TLS record length")
    if len(buf) < 5 + n:
        return False, None
    rec = buf[5 : 5 + n]
    if rec[0] != 1:
        raise ValueError("not a ClientHello")
    body = rec[4 : 4 + int.from_bytes(rec[1:4], "big")]
    try:
        p = 2 + 32  # legacy version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p : p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        end = min(len(body), p + 2 + int.from_bytes(body[p : p + 2], "big"))
        p += 2
        while p + 4 <= end:
            kind = int.from_bytes(body[p : p + 2], "big")
            size = int.from_bytes(body[p + 2 : p + 4], "big")
            p += 4
            if kind == 0:  # server_name: list length, type 0 (host_name), length, name
                data = body[p : p + size]
                if len(data) >= 5 and data[2] == 0:
                    name = data[5 : 5 + int.from_bytes(data[3:5], "big")]
                    host = name.decode("ascii").lower().rstrip(".")
                    return True, host if _HOST_RE.match(host) and len(host) <= 253 else None
            p += size
    except (IndexError, UnicodeDecodeError):
        raise ValueError("malformed ClientHello") from None
    return True, None


# --- HTTP/1.1 framing --------------------------------------------------------------------------


Headers = list[tuple[str, bytes, bytes]]  # (lowercased name, value, the raw line)


def parse_head(raw: bytes) -> tuple[bytes, Headers]:
    """The start line and the header lines of a head ending in CRLF CRLF. Strict: a folded,
    nameless or control-character line is refused, so the upstream reads what we read."""
    lines = raw[:-4].split(b"\r\n")
    headers: Headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN_RE.match(name):
            raise ProxyRefusal(400, "Bad Request", "malformed header line")
        if any(c < 0x20 and c != 0x09 or c == 0x7F for c in value):
            raise ProxyRefusal(400, "Bad Request", "control character in a header")
        headers.append((name.decode("ascii").lower(), value.strip(b" \t"), line))
    return lines[0], headers


def values(headers: Headers, name: str) -> list[bytes]:
    return [v for n, v, _ in headers if n == name]


def framing(headers: Headers, *, request: bool) -> tuple[str, int]:
    """How the body of a message ends: ("none"|"length"|"chunked"|"close", length)."""
    te, cl = values(headers, "transfer-encoding"), values(headers, "content-length")
    if te:
        if cl:
            raise ProxyRefusal(400, "Bad Request", "both Content-Length and Transfer-Encoding")
        codings = [c.strip().lower() for v in te for c in v.split(b",") if c.strip()]
        if codings and codings[-1] == b"chunked" and codings.count(b"chunked") == 1:
            return "chunked", 0
        if request:
            raise ProxyRefusal(501, "Not Implemented", "a request body must end in chunked")
        return "close", 0
    if cl:
        lengths = {v.strip() for c in cl for v in c.split(b",")}
        if len(lengths) != 1 or not (n := lengths.pop()).isdigit() or len(n) > 18:
            raise ProxyRefusal(400, "Bad Request", "bad Content-Length")
        return ("length", int(n)) if int(n) else ("none", 0)
    return ("none", 0) if request else ("close", 0)


def wants_close(headers: Headers, version: bytes) -> bool:
    tokens = {t.strip().lower() for v in values(headers, "connection") for t in v.split(b",")}
    return b"close" in tokens or (version == b"HTTP/1.0" and b"keep-alive" not in tokens)


class Masker:
    """Replaces every verbatim occurrence of the secret values in a byte stream by as many
    ``*``; a tail that may begin one is held back until more comes or :meth:`flush`."""

    def __init__(self, secret_values: Sequence[bytes]) -> None:
        self.secrets = sorted({s for s in secret_values if len(s) >= MASK_MIN}, key=len,
                              reverse=True)
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        if not self.secrets:
            return data
        buf = self.held + data
        for s in self.secrets:
            buf = buf.replace(s, b"*" * len(s))
        keep = 0
        for s in self.secrets:
            start = max(0, len(buf) - len(s) + 1)
            i = buf.find(s[:1], start)
            while i != -1:
                if s.startswith(buf[i:]):
                    keep = max(keep, len(buf) - i)
                    break
                i = buf.find(s[:1], i + 1)
        self.held = buf[len(buf) - keep :] if keep else b""
        return buf[: len(buf) - keep]

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out


def error_response(status: int, reason: str, message: str) -> bytes:
    body = f"ray_sandbox egress proxy: {message}\n".encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def request_line(start: bytes) -> tuple[bytes, bytes, bytes]:
    parts = start.split(b" ")
    if len(parts) != 3 or not _METHOD_RE.match(parts[0]) or \
            parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProxyRefusal(400, "Bad Request", "malformed request line")
    return parts[0], parts[1], parts[2]


def rewrite(start: bytes, headers: Headers, injected: Mapping[str, str]) -> bytes:
    """The head with the rule's headers in place of any the sandbox sent of those names."""
    names = {n.lower() for n in injected}
    lines = [start, *(raw for n, _, raw in headers if n not in names),
             *(f"{n}: {v}".encode() for n, v in injected.items())]
    return b"\r\n".join(lines) + b"\r\n\r\n"
