"""Shared by every plugin's tests: a registry built from the installed distributions, whatever other tests did."""

from __future__ import annotations

import pytest

from fabric_core.plugins import reset_registry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """Registries built by these tests see every installed plugin's entry point (core tests switch autoload off)."""
    for variable in ("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "FABRIC_PLUGINS", "FABRIC_DISABLE_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    reset_registry()
    yield
    reset_registry()
