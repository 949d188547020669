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
