"""The suite's own layout: shared helpers live in the fixtures and harness modules, never in a test file, so
a test file can move, split or be deselected without breaking another; and the rule that marks a test
``integration`` (tests/starters.py) sees a process started through a helper."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.starters import starts_processes

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


# test helpers as a test file would write them (compiled below, so that this test itself stays in-process)
EXAMPLES = """
import subprocess
from sim.broker import start_broker

def starts_a_broker(tmp_path):
    return start_broker(data_dir=tmp_path)

def through_a_helper(tmp_path):
    return [starts_a_broker(tmp_path)]

def runs_a_command():
    return subprocess.run(["true"], check=True)

def in_process():
    return sum(x * x for x in range(3))
"""


def test_a_process_started_directly_or_through_a_test_helper_makes_a_test_integration():
    examples = {"__name__": "tests.examples"}
    exec(compile(EXAMPLES, "examples", "exec"), examples)  # defines them; runs none
    assert starts_processes(examples["starts_a_broker"]) and starts_processes(examples["through_a_helper"])
    assert starts_processes(examples["runs_a_command"])
    assert not starts_processes(examples["in_process"])
