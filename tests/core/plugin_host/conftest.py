"""The ``use_registry`` fixture: a registry of the built-ins plus given plugin objects, process-wide for one test."""

from __future__ import annotations

from typing import Any

import pytest

from fabric_core.plugins import Registry, build_registry, set_registry


@pytest.fixture
def use_registry(monkeypatch: pytest.MonkeyPatch):
    """Make a registry of the built-ins plus ``plugins`` the process-wide one, for this test only.

    Entry-point autoload is off, so the result does not depend on what else is installed in the venv.
    """
    previous: list[Registry | None] = []

    def install(*plugins: Any) -> Registry:
        monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
        monkeypatch.delenv("FABRIC_PLUGINS", raising=False)
        registry = build_registry(extra_plugins=plugins)
        old = set_registry(registry)
        if not previous:
            previous.append(old)
        return registry

    yield install
    if previous:
        set_registry(previous[0])
