"""Every test here sees a registry built from the installed distributions, fabric-ddp included."""

from __future__ import annotations

import pytest

from fabric_core.registry import reset_registry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """Registries built by these tests see fabric-ddp's entry point, whatever other tests switched off."""
    monkeypatch.delenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("FABRIC_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()
