"""No import cycle between SkyFed's modules (docs/architecture.md, "Layers"), deferred ones included: every import
statement counts wherever it stands (inside a function, under ``if TYPE_CHECKING``), so a cycle cannot hide
behind a function-level import. ``from pkg import name`` where ``name`` is a submodule imports that submodule;
a package's ``__init__`` is a module of its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")  # every one shipped


def module_files() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name, for its ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The SkyFed modules that module ``name`` (at ``path``) imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]], among: set[str] | None = None) -> list[str] | None:
    """One cycle of ``graph`` (within ``among``, default everywhere) as the modules along it, the first repeated
    at the end; None if there is none."""
    among = set(graph) if among is None else among
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node] & among):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(among):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per knot of modules that import each other, each cut separately: a cycle's modules are set
    aside once named, so the next one found is another knot (or another loop of the same one)."""
    found, left = [], set(graph)
    while (cycle := find_cycle(graph, left)) is not None:
        found.append(cycle)
        left -= set(cycle)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_deferred_type_only_and_submodule_imports() -> None:
    graph = import_graph()
    assert "flcore.strategies.base" in graph["flcore.strategies"]  # a package's __init__ is a module
    assert "sim.inprocess" in graph["sim.run"]  # imported inside a function
    assert "protocol.broker_settings" in graph["protocol.mqtt_problems"]  # imported under TYPE_CHECKING
    assert "models.partition" in graph["sim.settings"]  # ``from models import partition``: the submodule
    assert {"common", "protocol", "security", "models", "flcore", "participant", "agent", "broker_server", "region",
            "sim", "skyfed", "benchmarks"} <= set(PACKAGES) and len(graph) > 200  # fmt: skip


def test_no_import_cycle() -> None:
    cycles = all_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_a_cycle_is_found_and_named() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert all_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b", "a"], ["c", "d", "c"]]
