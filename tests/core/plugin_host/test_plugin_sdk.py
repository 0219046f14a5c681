"""The plugin SDK is the core's faces, and nothing else: every first-party plugin imports only names that a face lists
in its ``__all__``, and reaches no private member of the core (docs/plugins.md, "The plugin SDK").

Read from the plugins' source (AST), so a new import of an internal module or a private name fails here, naming the
file and line, before it ships.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PLUGINS = REPO / "plugins"
CORE = REPO / "core" / "src" / "fabric_core"

#: The faces of the plugin SDK (docs/plugins.md lists the same ones; a test below compares).
FACES = (
    "fabric_core",
    "fabric_core.accelerators",
    "fabric_core.environments",
    "fabric_core.io",
    "fabric_core.launchers",
    "fabric_core.loggers",
    "fabric_core.plugins",
    "fabric_core.precision",
    "fabric_core.strategies",
    "fabric_core.utilities",
)


def _plugin_sources() -> list[Path]:
    return sorted(p for p in PLUGINS.glob("*/src/**/*.py"))


def _core_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every import of the core in ``path`` (``name`` is ``*`` for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fabric_core":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "*") for a in node.names if a.name.split(".")[0] == "fabric_core"]
    return found


def test_plugins_import_only_names_in_a_face_all():
    exported = {face: set(importlib.import_module(face).__all__) for face in FACES}
    wrong = []
    for path in _plugin_sources():
        for line, module, name in _core_imports(path):
            where = f"{path.relative_to(REPO)}:{line}"
            if module not in exported:
                wrong.append(f"{where}: imports from {module} (not a face of the SDK: use one of {', '.join(FACES)})")
            elif name not in exported[module]:
                wrong.append(f"{where}: {module}.{name} is not in that face's __all__")
    assert not wrong, "\n".join(wrong)


def test_every_name_a_face_lists_exists():
    """A face's ``__all__`` is a promise: every name in it imports."""
    missing = [
        f"{face}.{name}"
        for face in FACES
        for name in importlib.import_module(face).__all__
        if not hasattr(importlib.import_module(face), name)
    ]
    assert not missing


def _defined_private_names(root: Path) -> set[str]:
    """Private (``_x``) names a package defines itself: functions, classes, attributes it assigns, parameters."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_plugins_reach_no_private_member_of_the_core():
    """``obj._name`` in a plugin must be the plugin's own ``_name`` (or a library's), never one only the core defines."""
    import torch

    # torch's own private members (a module's ``_buffers``) are the library's, which the core also touches
    library = set(dir(torch.nn.Module())) | set(dir(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))
    core_private = _defined_private_names(CORE) - library
    wrong = []
    for package in sorted(PLUGINS.glob("*/src/*")):
        if not package.is_dir():
            continue
        own = _defined_private_names(package)
        for path in package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and node.attr in core_private
                    and node.attr not in own
                ):
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr} is private to fabric_core")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("face", FACES)
def test_the_faces_are_listed_in_the_plugin_guide_with_their_names(face):
    guide = (REPO / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## The plugin SDK") : guide.index("## The topology")]
    row = next((line for line in section.splitlines() if line.startswith(f"| `{face}` |")), None)
    assert row is not None, f"docs/plugins.md's SDK section does not list {face}"
    listed = set(re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1]))
    assert listed == set(importlib.import_module(face).__all__), f"the guide's names of {face} differ from its __all__"
