"""A strategy plugin can serve precision names that no precision plugin registers (through the hook)."""

from __future__ import annotations

import pytest

pytest.importorskip("fabric_fsdp")

from fabric_core import Fabric  # noqa: E402
from fabric_core.plugins import reset_registry  # noqa: E402


@pytest.fixture
def fsdp_without_amp(monkeypatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("FABRIC_PLUGINS", "fabric-fsdp")
    reset_registry()
    yield
    reset_registry()


def test_fsdp_serves_bf16_mixed_without_fabric_amp(fsdp_without_amp):
    from fabric_fsdp.precision import FSDPPrecision

    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, FSDPPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_other_strategies_still_get_the_install_hint(fsdp_without_amp, install_hint):
    with pytest.raises(ValueError, match=install_hint("fabric-amp")):
        Fabric(accelerator="cpu", precision="bf16-mixed")
