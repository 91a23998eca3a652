"""The suite's own layout: shared helpers live in the fixtures and harness modules, never in a test file, so
a test file can move, split or be deselected without breaking another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> set[str]:
    """The ``test_*`` modules a file imports, at any depth (a function's own imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            modules = [base, *(f"{base.rstrip('.')}.{a.name}" if node.module else base + a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        found.update(m for m in modules if m.split(".")[-1].startswith("test_"))
    return found


def test_no_test_file_imports_another():
    offenders = {p.name: imported_test_modules(p.read_text()) for p in sorted(TESTS.glob("test_*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}, (
        "move the shared helper into tests/fixtures.py (in-process) or tests/liveharness.py (live processes)"
    )


def test_the_check_sees_an_import_inside_a_function_and_a_relative_one():
    source = "def f():\n    from tests.test_peer import Peers\nfrom . import test_engine\nfrom tests import fixtures\n"
    assert imported_test_modules(source) == {"tests.test_peer", ".test_engine"}
