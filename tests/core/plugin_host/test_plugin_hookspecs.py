"""The hook specifications (``fabric_core.plugins.hookspecs``) and the kinds (``fabric_core.plugins.kinds``): every
hook has a contract, a test and a documented signature; every kind has its registration hook."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fabric_core.plugins import hookspecs
from fabric_core.plugins.kinds import KINDS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
HOOK_NAMES = sorted(name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec"))
REGISTRATION_HOOKS = sorted(name for name in HOOK_NAMES if name.startswith("fabric_register_"))


def test_hookspecs_module_declares_the_expected_hooks():
    assert len(HOOK_NAMES) >= 12
    assert {
        "fabric_register_strategies",
        "fabric_auto_accelerator",
        "fabric_adjust_strategy",
        "fabric_register_checkpoint_formats",
    } <= set(HOOK_NAMES)
    assert set(hookspecs.HOOK_NAMES) == set(HOOK_NAMES)


def test_every_kind_has_its_registration_hook_and_every_registration_hook_a_kind():
    """Adding a kind is one line in ``kinds.py`` plus its hook: the two must agree, and the docs list each kind."""
    assert sorted(KINDS.values()) == REGISTRATION_HOOKS
    for hook_name in KINDS.values():
        assert not getattr(hookspecs, hook_name).fabric_spec.get("firstresult"), hook_name
        assert list(inspect.signature(getattr(hookspecs, hook_name)).parameters) == ["registrar"]
    docs = (REPO / "docs" / "plugins.md").read_text()
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \| `(fabric_register_\w+)` \|", docs, re.M)}
    assert table == KINDS, "docs/plugins.md's table of kinds must list every kind with its hook"


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hookspec_has_a_docstring(hook_name):
    doc = inspect.getdoc(getattr(hookspecs, hook_name))
    assert doc and len(doc.split()) >= 10, f"{hook_name} needs a docstring that states its contract"


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_has_a_test(hook_name):
    sources = "\n".join(path.read_text() for path in sorted(HERE.glob("test_plugin_*.py")))
    assert re.search(rf"^def test_hook_{hook_name}", sources, re.M), (
        f"write a test named test_hook_{hook_name}... in one of {HERE.name}/test_plugin_*.py"
    )


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_is_documented_with_its_signature(hook_name):
    docs = (REPO / "docs" / "plugins.md").read_text()
    params = ", ".join(inspect.signature(getattr(hookspecs, hook_name)).parameters)
    assert f"### `{hook_name}({params})`" in docs
