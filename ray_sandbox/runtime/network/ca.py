"""The certificate authority of one sandbox's egress proxy, and the certificates it issues.

Each sandbox created with ``EgressPolicy.inject`` gets a CA of its own (docs/network.md,
"Credential injection"): its certificate is added to the sandbox's trust store (the bundle
``runtime/bundle.py`` mounts), its key stays in the sandbox's state directory on the host
(mode 0600, never mounted) and signs, in the proxy, one short-lived certificate per name the
sandbox reaches through it. One CA per sandbox rather than per node: a key that leaked would
open one sandbox's TLS, not every sandbox's on the node, and nothing node-wide has to be kept,
rotated or cleaned up. ECDSA P-256: a CA costs ~2 ms to make, a leaf ~0.2 ms to sign.

The certificates satisfy OpenSSL's strict checks (Python >= 3.13's default context sets
VERIFY_X509_STRICT): critical basic constraints and key usage, subject and authority key
identifiers, the name in subjectAltName.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..secrets import CA_FILE, CA_KEY_FILE

CA_DAYS = 3650  # the CA lives as long as its sandbox may
LEAF_DAYS = 7  # the proxy issues a new one before this runs out
_BACKDATE = datetime.timedelta(hours=1)  # a sandbox clock a little behind still accepts it


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(state_dir: Path, sandbox_id: str) -> bytes:
    """Write a new CA's key and certificate into ``state_dir``; returns the certificate
    (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name(f"ray_sandbox egress proxy {sandbox_id[:12]}")
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.open(state_dir / CA_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (state_dir / CA_FILE).write_bytes(pem)
    return pem


class Issuer:
    """Signs leaf certificates for names with the CA in ``state_dir`` (the proxy's side)."""

    def __init__(self, state_dir: Path) -> None:
        key = serialization.load_pem_private_key((state_dir / CA_KEY_FILE).read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the proxy's CA key is not an EC key")
        self._ca_key = key
        self._ca = x509.load_pem_x509_certificate((state_dir / CA_FILE).read_bytes())
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # one for every name
        self.leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())

    def leaf(self, host: str) -> tuple[bytes, float]:
        """A certificate for ``host`` (PEM, followed by the CA's) and when it expires (epoch
        seconds)."""
        now = datetime.datetime.now(datetime.UTC)
        until = now + datetime.timedelta(days=LEAF_DAYS)
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(host)).issuer_name(self._ca.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                self._leaf_key.public_key()), critical=False)
            .add_extension(aki, critical=False)
            .sign(self._ca_key, hashes.SHA256())
        )  # fmt: skip
        chain = cert.public_bytes(serialization.Encoding.PEM) + \
            self._ca.public_bytes(serialization.Encoding.PEM)
        return chain, until.timestamp()
