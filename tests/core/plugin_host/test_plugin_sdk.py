"""The plugin SDK is the core's faces, and nothing else: every first-party plugin imports only names that a face lists
in its ``__all__``, reaches no private member of the core, and copies none of the helpers the faces publish
(docs/plugins.md, "The plugin SDK"). The counts come from ``tests/architecture.py`` (AST), which
``python tests/architecture.py`` prints with the limits docs/decisions.md states.

Read from the plugins' source, so a new import of an internal module, a private name or a copied helper fails here,
naming the file and line, before it ships.
"""

from __future__ import annotations

import importlib
import re

import architecture
import pytest
from architecture import FACES, LIMITS, REPO


def _listing(findings) -> str:
    return "\n".join(str(f) for f in findings)


def test_plugins_import_only_names_in_a_face_all():
    wrong = architecture.names_outside_all()
    assert not wrong, _listing(wrong)
    assert len(architecture.imported_core_modules()) <= LIMITS["core modules imported by plugins"]


def test_every_name_a_face_lists_exists():
    """A face's ``__all__`` is a promise: every name in it imports."""
    missing = [
        f"{face}.{name}"
        for face in FACES
        for name in importlib.import_module(face).__all__
        if not hasattr(importlib.import_module(face), name)
    ]
    assert not missing


def test_plugins_reach_no_private_member_of_the_core():
    """``obj._name`` in a plugin must be the plugin's own ``_name`` (or a library's), never one only the core defines."""
    wrong = architecture.private_reaches(architecture.torch_private_members())
    assert not wrong, _listing(wrong)


def test_plugins_copy_no_helper_a_face_publishes():
    """A free port, a process group stopped by hand, the death signal, ``128 - code``, the default dtype, an env
    reader, torchrun's variables, a rename into place, a missing package's reason: each is called, not copied."""
    wrong = architecture.copied_helpers()
    assert not wrong, _listing(wrong)


def test_no_shims_and_no_attach_override_re_declares_the_binding():
    assert not architecture.shims(), _listing(architecture.shims())
    wrong = architecture.attach_redeclaring()
    assert not wrong, _listing(wrong)


@pytest.mark.parametrize("face", FACES)
def test_the_faces_are_listed_in_the_plugin_guide_with_their_names(face):
    guide = (REPO / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## The plugin SDK") : guide.index("## The topology")]
    row = next((line for line in section.splitlines() if line.startswith(f"| `{face}` |")), None)
    assert row is not None, f"docs/plugins.md's SDK section does not list {face}"
    listed = set(re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1]))
    assert listed == set(importlib.import_module(face).__all__), f"the guide's names of {face} differ from its __all__"


def test_broad_excepts_are_few_and_each_says_why():
    """``except Exception``/``BaseException``/bare ``except`` (and calls of ``utilities.guarded``, a catch-all that
    hands the error back) stay within docs/decisions.md's limits, and each ``except`` says on its line why it must
    be broad."""
    core, plugins = architecture.broad_excepts_in_core(), architecture.broad_excepts_in_plugins()
    assert len(core) <= LIMITS["broad excepts in the core"], _listing(core)
    assert len(plugins) <= LIMITS["broad excepts in the plugins"], _listing(plugins)
    assert not architecture.unexplained(core + plugins), _listing(architecture.unexplained(core + plugins))
    calls = architecture.guarded_calls([*architecture.core_sources(), *architecture.plugin_sources()])
    assert len(calls) <= LIMITS["broad catches through guarded()"], _listing(calls)


def test_on_failure_cleans_up_on_any_failure_and_catches_nothing():
    from fabric_core.utilities import guarded, on_failure

    cleaned = []
    with pytest.raises(KeyboardInterrupt), on_failure(lambda: cleaned.append("interrupt")):
        raise KeyboardInterrupt
    with on_failure(lambda: cleaned.append("success")):
        pass
    assert cleaned == ["interrupt"]
    assert guarded(int, "3") == (3, None)
    value, err = guarded(int, "x")
    assert value is None and isinstance(err, ValueError)
    with pytest.raises(SystemExit):
        guarded(lambda: (_ for _ in ()).throw(SystemExit(2)))
