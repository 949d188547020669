"""The C agent's wire constants (wire.h) and the Python protocol module agree: they are kept
in sync by hand, so this reads both and compares every name (issue 16)."""

from __future__ import annotations

import re
from pathlib import Path

from ray_sandbox.runtime.agent import protocol as p

WIRE_H = Path(p.__file__).with_name("wire.h").read_text()
# the C prefix of each enum family -> the Python enum that mirrors it
FAMILIES = {"T_": (p.Op, p.Stream, p.Reply), "G_": (p.Tag,)}


def _c_constants() -> dict[str, int]:
    out = {}
    for body in re.findall(r"enum\s*\{(.*?)\}", WIRE_H, re.S):
        for name, value in re.findall(r"\b([TG]_[A-Z0-9_]+)\s*=\s*(0x[0-9a-fA-F]+|\d+)", body):
            out[name] = int(value, 0)
    return out


def _py_constants() -> dict[str, int]:
    out = {}
    for prefix, enums in FAMILIES.items():
        for enum in enums:
            for member in enum:
                out[prefix + member.name] = int(member)
    return out


def _define(name: str) -> int:
    m = re.search(rf"#define {name} \(?(\d+)u?(?: << (\d+)\))?", WIRE_H)
    assert m, f"{name} is not defined in wire.h"
    return int(m.group(1)) << int(m.group(2) or 0)


def test_every_frame_type_and_tag_matches():
    c, py = _c_constants(), _py_constants()
    assert len(c) > 40  # the parse found the enums
    assert c == py


def test_frame_limits_and_version_match():
    assert _define("PROTOCOL_VERSION") == p.PROTOCOL_VERSION
    assert _define("FRAME_MAX") == p.FRAME_MAX
    assert _define("FRAME_HDR") == p.HEADER.size
