"""Signed, expiring tokens for a sandbox's published port (pure): ``claims.signature``, both
base64url, the signature an HMAC-SHA256 of the claims under the service's key."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from typing import Any


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: bytes, claims: dict[str, Any]) -> str:
    payload = _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
    mac = hmac.new(key, payload.encode(), hashlib.sha256).digest()
    return f"{payload}.{_b64(mac)}"


def verify(key: bytes, token: str, now: float) -> tuple[dict[str, Any] | None, str]:
    """``(claims, "")`` for a genuine token not expired at ``now``, else ``(None, why)``."""
    payload, dot, mac = token.partition(".")
    if not dot or len(token) > 2048:
        return None, "malformed token"
    try:
        given = _unb64(mac)
    except (ValueError, binascii.Error):
        return None, "malformed token"
    want = hmac.new(key, payload.encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(given, want):
        return None, "bad signature"
    claims = json.loads(_unb64(payload))  # ours: it carries our signature
    if not isinstance(claims.get("exp"), int | float) or claims["exp"] <= now:
        return None, "expired token"
    return claims, ""


# --- the host form: one DNS label (at most 63 characters) instead of a path segment ------------

_LABEL_MAC = 10  # bytes of HMAC in a label: 80 bits


def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode().rstrip("=").lower()


def _unb32(text: str) -> bytes:
    return base64.b32decode(text.upper() + "=" * (-len(text) % 8))


def _label_mac(key: bytes, sandbox_id: str, port: int, exp: int) -> bytes:
    return hmac.new(key, f"host:{sandbox_id}:{port}:{exp}".encode(),
                    hashlib.sha256).digest()[:_LABEL_MAC]


def label(key: bytes, sandbox_id: str, port: int, exp: int) -> str:
    """``p<port>-<exp, base36>-<sandbox id, base32>-<mac, base32>``: 58 characters at most,
    lower case, so it is one label of a host name under a wildcard (``*.ports.example``)."""
    return (f"p{port}-{_b36(exp)}-{_b32(bytes.fromhex(sandbox_id))}-"
            f"{_b32(_label_mac(key, sandbox_id, port, exp))}")


def verify_label(key: bytes, text: str, now: float) -> tuple[tuple[str, int] | None, str]:
    """``((sandbox id, port), "")`` for a genuine label not expired at ``now``, else
    ``(None, why)``."""
    parts = text.lower().split("-")
    if len(parts) != 4 or not parts[0].startswith("p") or len(text) > 63:
        return None, "malformed host"
    try:
        port, exp = int(parts[0][1:]), int(parts[1], 36)
        sandbox_id = _unb32(parts[2]).hex()
        given = _unb32(parts[3])
    except (ValueError, binascii.Error):
        return None, "malformed host"
    if not hmac.compare_digest(given, _label_mac(key, sandbox_id, port, exp)):
        return None, "bad signature"
    if exp <= now:
        return None, "expired host"
    return (sandbox_id, port), ""


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out
