"""Sandbox options on the command line: any SandboxConfig field as ``--opt KEY=VALUE``, the
common ones also as their own flags, for ``ray-sandbox run``/``create`` and ``mcp serve``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer

from ..runtime.config import SandboxConfig, make_config
from ..runtime.errors import ConfigError

# Every field but spec_transform, a Python callable that no command line can name.
KEYS = tuple(sorted(n for n in SandboxConfig.model_fields if n != "spec_transform"))

Opts = Annotated[list[str] | None, typer.Option(
    "--opt", metavar="KEY=VALUE",
    help="any sandbox option (repeatable), like docker's --log-opt: pids_limit=256, "
    "directfs=false, 'capabilities=[\"CAP_CHOWN\"]', 'egress={\"default\": \"deny\"}'; "
    "lists and objects as JSON, null for none, '-' in KEY as '_'. KEY is one of: "
    + ", ".join(KEYS),
)]


def parse_opts(items: Sequence[str]) -> dict[str, Any]:
    """``--opt`` values as SandboxConfig fields. Scalars stay strings for SandboxConfig to
    convert, so that ``user=1000`` remains a string where ``pids_limit=256`` becomes a number."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or not name:
            raise ConfigError(f"--opt needs KEY=VALUE, got {item!r}")
        if name not in KEYS:
            raise ConfigError(f"unknown sandbox option {key.strip()!r}; known: {', '.join(KEYS)}")
        if name in out:
            raise ConfigError(f"sandbox option {name!r} is given twice")
        out[name] = _value(name, text)
    return out


def _value(name: str, text: str) -> Any:
    if text == "null":
        return None
    if not text.startswith(("[", "{")):
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"sandbox option {name!r}: {text!r} is not JSON ({exc})") from None


def sandbox_config(
    opts: Sequence[str] | None,
    base: SandboxConfig | Mapping[str, Any] | None = None,
    **flags: Any,
) -> SandboxConfig:
    """``base`` with the shortcut ``flags`` (None = not given) and the ``--opt`` items over
    it, validated by SandboxConfig. An option set both ways is a ConfigError naming it."""
    options = parse_opts(opts or ())
    given = {k: v for k, v in flags.items() if v is not None}
    if both := sorted(given.keys() & options.keys()):
        raise ConfigError(f"sandbox option(s) {', '.join(both)} set both by a flag and by --opt")
    return make_config(base, **given, **options)
