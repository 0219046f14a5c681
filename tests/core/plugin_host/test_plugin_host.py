"""The plugin host as a unit (``fabric_core.plugins``): imports flow one way, the process-wide registry can be
replaced and restored, and what the resolver hands a strategy survives being sent to a spawned process."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import fabric_core.plugins as plugins_package
from fabric_core.io import CheckpointLocation
from fabric_core.plugins import build_registry, get_registry, reset_registry, set_registry

PACKAGE = Path(plugins_package.__file__).resolve().parent


def _module_order() -> list[str]:
    """The modules in the order the package docstring lists them (lowest first)."""
    doc = plugins_package.__doc__ or ""
    return re.findall(r"^    (\w+)\s{2,}", doc, re.M)


def _runtime_imports(path: Path) -> set[str]:
    """``fabric_core.plugins.<module>`` names ``path`` imports at run time (not under ``TYPE_CHECKING``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module:
                if child.module.startswith("fabric_core.plugins."):
                    found.add(child.module.split(".")[2])
                elif child.module == "fabric_core.plugins":
                    found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(a.name.split(".")[2] for a in child.names if a.name.startswith("fabric_core.plugins."))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_package_docstring_lists_every_module_of_the_host():
    assert sorted(_module_order()) == sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_imports_flow_one_way_down_the_documented_order():
    """Each module imports only modules listed before it: no cycle, and the process-wide registry (``host``) on top."""
    order = _module_order()
    assert order[-1] == "host"
    for position, module in enumerate(order):
        imported = _runtime_imports(PACKAGE / f"{module}.py")
        assert imported <= set(order[:position]), f"{module} imports {sorted(imported - set(order[:position]))}"


def test_set_registry_replaces_and_restores_the_process_wide_registry(monkeypatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    mine = build_registry()
    previous = set_registry(mine)
    try:
        assert get_registry() is mine
        reset_registry()
        rebuilt = get_registry()
        assert rebuilt is not mine and rebuilt.names("strategy") == mine.names("strategy")
    finally:
        set_registry(previous)
    assert get_registry() is previous or previous is None


def test_the_registered_formats_travel_to_spawned_processes(tmp_path):
    """A strategy sent to spawned processes carries the registered formats it asks when loading: they pickle, and
    the copies still recognise (and build) their formats."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"")  # what fabric-fsdp's format looks for first
    registered = build_registry().registered_formats()
    copies = pickle.loads(pickle.dumps(registered))
    assert [r.name for r in copies] == [r.name for r in registered] and "single_file" in [r.name for r in copies]
    file = tmp_path / "plain.ckpt"
    file.write_bytes(b"x")
    assert [type(r.recognising(CheckpointLocation.of(file))).__name__ for r in copies if r.name == "single_file"] == [
        "SingleFileFormat"
    ]
