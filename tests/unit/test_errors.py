"""One error tree (issue 16): every exception class lives in runtime/errors.py, shows its
public name, and survives pickling (Ray ships errors between processes)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import ray_sandbox
from ray_sandbox.runtime import errors

PACKAGE = Path(ray_sandbox.__file__).parent


def test_no_exception_class_outside_the_errors_module():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == Path(errors.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "Error" in ast.unparse(b) or "Exception" in ast.unparse(b)
                    for b in node.bases):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert found == []


def test_public_errors_show_and_pickle_under_their_public_name():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls.__module__ == "ray_sandbox" and getattr(ray_sandbox, name) is cls
        err = cls("boom", sandbox_id="ab" * 16) if issubclass(cls, errors.SandboxError) else cls()
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err)
