"""The package layering of docs/architecture.md ("Layers"), checked on every import statement: the core and
the participant's half import no daemon, and the two daemons never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"common", "protocol", "security", "models"}
ALLOWED = {
    "common": set(),
    "flcore": BASE,
    "participant": BASE | {"flcore"},
    "agent": BASE | {"flcore", "participant"},
    "broker_server": BASE | {"flcore", "participant"},
    "region": BASE | {"flcore", "participant", "agent", "broker_server"},
    "skyfed": BASE | {"flcore", "participant", "agent", "broker_server", "region", "sim"},  # the command and API
}
PACKAGES = {*ALLOWED, "sim", "benchmarks", "tests"}


def skyfed_imports(path: Path) -> set[str]:
    """The SkyFed packages a module imports (anywhere in it, type-only imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[0] for n in names} & PACKAGES
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(bad)
        for path in sorted((ROOT / package).rglob("*.py"))
        if (bad := skyfed_imports(path) - ALLOWED[package] - {package})
    }
    assert wrong == {}
