"""The HTTPS upstreams of the credential-injection tests: real TLS servers, with a CA of their
own, in the fake internet (tests/fx_network.py: ``api.test`` and ``other.test``), recording
every request that reaches them. Nothing leaves the test namespaces."""

from __future__ import annotations

import datetime
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ray_sandbox.runtime.network import netns as _netns
from tests.fx_network import API, DNS_SERVER, INET, OTHER, FakeInternet

UPSTREAMS = {"api.test": API, "other.test": OTHER}
TEST_DNS = (DNS_SERVER,)


@dataclass(frozen=True)
class Seen:
    """One request as an upstream received it."""

    host: str  # which server (its name)
    method: str
    path: str
    headers: dict[str, list[str]]  # lowercased name -> values


@dataclass
class Upstreams:
    ca_file: Path  # the upstreams' CA (what the proxy must trust, and the sandbox for them)
    ca_pem: str
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def requests(self, host: str, path: str | None = None) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.host == host and (path is None or s.path == path)]

    def clear(self) -> None:
        with self.lock:
            self.seen.clear()


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          signer: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                        critical=False))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]),
                            critical=False).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
            critical=False)
    return b.sign(signer, hashes.SHA256())


def _handler(name: str, ups: Upstreams) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # the head and the body are two writes

        def _handle(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers: dict[str, list[str]] = {}
            for k, v in self.headers.items():
                headers.setdefault(k.lower(), []).append(v)
            with ups.lock:
                ups.seen.append(Seen(name, self.command, self.path, headers))
            status, extra = 200, {}
            if self.path.startswith("/redirect"):
                status, extra = 302, {"Location": "https://other.test/landing"}
                out = b"moved\n"
            elif self.path == "/echo":  # an upstream that reflects what it got
                out = "".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode()
            else:
                out = f"{name} ok {len(body)}\n".encode()
            self.send_response(status)
            for k, v in extra.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _handle

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def https_upstreams(work: Path) -> Iterator[Upstreams]:
    """Start ``api.test`` and ``other.test`` on port 443 in the fake internet."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rsbt upstream CA")])
    ca = _cert("rsbt upstream CA", ca_key, ca_name, ca_key, ca=True)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    ca_file = work / "upstream-ca.pem"
    ca_file.write_text(ca_pem)
    ups = Upstreams(ca_file, ca_pem)
    servers: list[ThreadingHTTPServer] = []
    try:
        for name, addr in UPSTREAMS.items():
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(name, key, ca_name, ca_key, ca=False)
            (work / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            (work / f"{name}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(work / f"{name}.pem", work / f"{name}.key")

            def make(addr: str = addr, name: str = name) -> ThreadingHTTPServer:
                return ThreadingHTTPServer((addr, 443), _handler(name, ups))

            server = _netns.run_in(INET, make)
            server.daemon_threads = True
            # the handshake happens in the handler's thread (its first read), not in accept
            server.socket = ctx.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
            servers.append(server)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        yield ups
    finally:
        for server in servers:
            server.shutdown()
            with suppress(OSError):
                server.server_close()


@pytest.fixture(scope="module")
def https_upstream(fake_internet: FakeInternet,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstreams]:
    with https_upstreams(tmp_path_factory.mktemp("rsbt-https")) as ups:
        yield ups


@pytest.fixture
def inject_env(https_upstream: Upstreams, upstream: FakeInternet,
               monkeypatch: pytest.MonkeyPatch) -> Upstreams:
    """Sandboxes attached in the test egress into the fake internet, and their proxies trust
    the upstreams' CA."""
    monkeypatch.setenv("RAY_SANDBOX_NET_INJECT_CA", str(https_upstream.ca_file))
    https_upstream.clear()
    return https_upstream
