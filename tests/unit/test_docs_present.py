"""The docs and the code describe the present and cite only what the repository holds.

- The runsc, kernel and VM facts the code relies on are in docs/platform.md, cited by section
  title (``docs/platform.md, "Orphaned runsc processes"``); no file cites the platform notes
  kept outside the repository (their file name or a section number of theirs), and every
  cited title exists.
- No text in docs/ or ray_sandbox/ dates itself by a working session ("ninth session", "this
  session's first CI"): history belongs in commit messages, dated figures in
  benchmarks/RESULTS.md, the lab notebook.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLATFORM_DOC = ROOT / "docs" / "platform.md"
TEXT_SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".toml", ".yaml", ".yml", ".json", ".txt", ""}
SCANNED = ("docs", "ray_sandbox", "tests", "benchmarks", "scripts", "kuberay", "examples", ".ci")
# Rewritten as a whole separately (it keeps the rules and the module table only).
NOT_YET: set[str] = set()

OUTSIDE_CITATION = re.compile(r"PLATFORM(\.md|\s*§)")
# A citation: the file name, a comma and the section's title in double quotes (a line break,
# and a comment's "#", may sit between).
CITATION = re.compile(r'platform\.md,\s*(?:#\s*)?"([^"\n]+)"')
SESSION = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|earlier|later"
    r"|next|previous)\s+session", re.IGNORECASE)
# Where "session" is the MCP feature ("this session's handle"), only an ordinal is a date.
ORDINAL_SESSION = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)\s+session",
    re.IGNORECASE)
MCP_FEATURE = ("docs/mcp.md", "ray_sandbox/mcp/", "ray_sandbox/cli/mcp.py")


def _files(*tops: str) -> list[tuple[str, str]]:
    """(path relative to the repository, text) of every text file under ``tops``."""
    out = []
    for top in tops:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            if (not path.is_file() or path.suffix not in TEXT_SUFFIXES
                    or "__pycache__" in path.parts or rel in NOT_YET):
                continue
            try:
                out.append((rel, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue  # a build product (the agent binary)
    return out


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_no_citation_of_a_platform_document_outside_the_repository():
    found = [f"{rel}:{_line(text, m.start())}: {m.group(0)}"
             for rel, text in _files(*SCANNED, "README.md")
             if rel != "docs/platform.md"
             for m in OUTSIDE_CITATION.finditer(text)]
    assert not found, "cite docs/platform.md by section title instead:\n" + "\n".join(found)


def test_every_platform_citation_names_a_section():
    titles = {line[3:].strip() for line in PLATFORM_DOC.read_text().splitlines()
              if line.startswith("## ")}
    cited = [(rel, _line(text, m.start()), m.group(1))
             for rel, text in _files(*SCANNED, "README.md")
             for m in CITATION.finditer(text)]
    assert cited, "no citation of docs/platform.md found: is the pattern still right?"
    wrong = [f"{rel}:{line}: {title!r}" for rel, line, title in cited if title not in titles]
    assert not wrong, (f"no such section in docs/platform.md ({sorted(titles)}):\n"
                       + "\n".join(wrong))


def test_no_session_words_in_docs_or_code():
    found = []
    for rel, text in _files("docs", "ray_sandbox"):
        pattern = ORDINAL_SESSION if rel.startswith(MCP_FEATURE) else SESSION
        found += [f"{rel}:{_line(text, m.start())}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not found, ("describe the present; history goes in commit messages and dated "
                       "figures in benchmarks/RESULTS.md:\n" + "\n".join(found))
