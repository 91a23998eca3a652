"""The package layering of docs/architecture.md ("Layout", "Layers"), checked on every import statement and
every plug-in registry's ``"package.module:Attribute"``: the core and the participant's half import no daemon,
the two daemons never import each other, ``security/`` holds only cryptography, and no top-level folder of
Python code escapes the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"common", "protocol", "security", "models"}
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "security": {"common"},  # cryptography only: keys, envelopes, signing, replay, PKI
    "protocol": {"common", "security"},
    "models": {"common"},
    "flcore": BASE,
    "participant": BASE | {"flcore"},
    "agent": BASE | {"flcore", "participant"},
    "broker_server": BASE | {"flcore", "participant"},
    "region": BASE | {"flcore", "participant", "agent", "broker_server"},
    "provisioning": {"common", "protocol", "security"},  # the operator's tools: no daemon imports them
}
SHIPPED = {*ALLOWED, "sim", "skyfed"}  # the packages setup.cfg installs
ALLOWED |= {
    "sim": SHIPPED - {"skyfed"},  # the command runs the sim, never the other way round
    "skyfed": SHIPPED,  # the command and the API
    "benchmarks": SHIPPED,
    "experiments": SHIPPED | {"benchmarks"},
    "docs": {"skyfed"},  # examples use the public API only
}
ALLOWED["tests"] = set(ALLOWED)
PLUGIN = re.compile(r"([A-Za-z_]\w*)(\.\w+)*:[A-Za-z_]\w*")  # a registry's "package.module:Attribute"


def skyfed_imports(path: Path) -> set[str]:
    """The SkyFed folders a module imports (anywhere in it, type-only imports and plug-in names included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (plugin := PLUGIN.fullmatch(node.value)):
            names = [plugin.group(1)]
        found |= {n.split(".")[0] for n in names} & set(ALLOWED)
    return found


def ignored_folders() -> set[str]:
    """Top-level folders .gitignore names (``build/`` holds setuptools' copies of the packages)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip().strip("/") for line in lines if re.fullmatch(r"/?[\w.-]+/", line.strip())}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(bad)
        for path in sorted((ROOT / package).rglob("*.py"))
        if (bad := skyfed_imports(path) - ALLOWED[package] - {package})
    }
    assert wrong == {}


def test_every_folder_of_python_code_has_a_layer_and_a_row_in_the_layout_table() -> None:
    """A new folder cannot escape the check: it needs its entry above, and its row in docs/architecture.md."""
    folders = {
        path.name
        for path in ROOT.iterdir()
        if path.is_dir() and not path.name.startswith(".") and path.name not in ignored_folders()
        if next(path.rglob("*.py"), None) is not None
    }
    assert folders == set(ALLOWED)
    documented = set(re.findall(r"^\| `(\w+)/` \|", (ROOT / "docs" / "architecture.md").read_text(), re.MULTILINE))
    assert set(ALLOWED) - documented == set()


def test_a_plugin_name_counts_as_an_import(tmp_path: Path) -> None:
    module = tmp_path / "plugins.py"
    module.write_text('STRATEGIES.add("x", "broker_server.rounds.engine:Engine")\nNOTE = "see agent.cli"\n')
    assert skyfed_imports(module) == {"broker_server"}
