"""The registry (``fabric_core.plugins.registry``): the registration hooks, names (case, aliases, conflicts, first-party
reservations) and the errors a name that resolves to nothing gives.

Plugins are objects registered with ``build_registry(extra_plugins=...)`` (the ``use_registry`` fixture).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from plugin_doubles import (
    AlwaysHereEnvironment,
    CountingCPUAccelerator,
    NeedsLauncherStrategy,
    RecordingLauncher,
    RecordingStrategy,
)

from fabric_core import Fabric
from fabric_core.plugins import FabricPluginWarning, hookimpl
from fabric_core.precision.double import DoublePrecision
from fabric_core.precision.full import FullPrecision

REPO = Path(__file__).resolve().parents[3]


def test_hook_fabric_register_accelerators(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_accelerators(self, registrar):
            registrar.add("Counting_CPU", CountingCPUAccelerator, description="a CPU accelerator subclass")

    registry = use_registry(Plugin())
    assert "counting_cpu" in registry.names("accelerator")
    fabric = Fabric(accelerator="COUNTING_cpu", devices=1)
    assert type(fabric.accelerator) is CountingCPUAccelerator
    assert fabric.device == torch.device("cpu")


def test_hook_fabric_register_precisions(use_registry):
    class TestDouble(DoublePrecision):
        pass

    class Plugin:
        @hookimpl
        def fabric_register_precisions(self, registrar):
            registrar.add(
                "test-64", TestDouble, aliases={"t64": "precision='t64' is old, use 'test-64'.", "T-64": None}
            )

    use_registry(Plugin())
    with pytest.warns(UserWarning, match="precision='t64' is old"):
        fabric = Fabric(accelerator="cpu", precision="t64")
    assert type(fabric.strategy.precision) is TestDouble
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent alias warns about nothing
        assert type(Fabric(accelerator="cpu", precision="t-64").strategy.precision) is TestDouble


def test_hook_fabric_register_launchers(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_launchers(self, registrar):
            registrar.add("recording", RecordingLauncher)

        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("needs_launcher", NeedsLauncherStrategy)

    use_registry(Plugin())
    fabric = Fabric(accelerator="cpu", strategy="needs_launcher")
    launcher = fabric.strategy.launcher
    assert type(launcher) is RecordingLauncher and launcher.strategy is fabric.strategy
    assert fabric.launch(lambda f: f.world_size * 7) == 7
    assert len(launcher.launched) == 1


def test_hook_fabric_register_environments(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_environments(self, registrar):
            registrar.add("always_here", AlwaysHereEnvironment)

        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

    registry = use_registry(Plugin())
    assert "always_here" in registry.names("environment")
    fabric = Fabric(accelerator="cpu", strategy="recording")
    assert (
        type(fabric.strategy.cluster_environment) is AlwaysHereEnvironment
    )  # detected by the core's default


def test_conflict_with_a_builtin_keeps_the_builtin(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("single_device", RecordingStrategy)

        @hookimpl
        def fabric_register_accelerators(self, registrar):
            registrar.add("cpu", CountingCPUAccelerator, override=True)

    with pytest.warns(FabricPluginWarning) as record:
        registry = use_registry(Plugin())
    messages = [str(w.message) for w in record]
    assert registry.get("strategy", "single_device").distribution == "fabric-core"
    assert registry.get("accelerator", "cpu").load() is CountingCPUAccelerator
    assert any("'single_device'" in m and "first registration wins" in m for m in messages)
    assert any("'cpu'" in m and "override=True" in m for m in messages)
    assert sorted((c.name, c.loser, c.winner) for c in registry.conflicts) == [
        ("cpu", "fabric-core", "Plugin"),
        ("single_device", "Plugin", "fabric-core"),
    ]


def test_a_first_party_name_is_reserved_while_its_distribution_is_absent(use_registry, install_hint):
    class Squatter:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("ddp", RecordingStrategy)
            registrar.add("fsdp", RecordingStrategy, override=True)

    with pytest.warns(FabricPluginWarning) as record:
        registry = use_registry(Squatter())  # autoload is off here: fabric-ddp and fabric-fsdp are not loaded
    assert ("strategy", "ddp") not in registry
    assert any("'ddp' registered by Squatter is ignored: fabric-ddp has it (it is reserved" in str(w.message) for w in record)
    with pytest.raises(ValueError, match=install_hint("fabric-ddp")):
        Fabric(accelerator="cpu", strategy="ddp")
    # override=True takes a reserved name, visibly.
    assert registry.get("strategy", "fsdp").distribution == "Squatter"
    assert any("'fsdp' of fabric-fsdp is replaced by Squatter" in str(w.message) for w in record)


def test_names_are_case_insensitive(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("MixedCase_Strategy", RecordingStrategy, aliases={"Short": None})

    registry = use_registry(Plugin())
    assert registry.names("strategy") == ["mixedcase_strategy", "single_device"]
    for spelling in ("MIXEDCASE_STRATEGY", "mixedcase_strategy", "short", "SHORT"):
        assert ("strategy", spelling) in registry
    fabric = Fabric(accelerator="CPU", strategy="MixedCase_Strategy", precision="32-TRUE")
    assert type(fabric.strategy) is RecordingStrategy and type(fabric.strategy.precision) is FullPrecision


def test_unknown_name_lists_available_names_and_the_closest(use_registry):
    use_registry()
    with pytest.raises(ValueError) as info:
        Fabric(accelerator="cpu", strategy="singel_device")
    message = str(info.value)
    assert "Did you mean 'single_device'?" in message
    assert re.search(r"Available names are: .*single_device", message)
    with pytest.raises(ValueError, match=r"Available names are: auto, cpu, cuda, mps\. Did you mean 'cpu'\?"):
        Fabric(accelerator="cpus")


@pytest.mark.parametrize(
    ("kind", "name", "distribution"),
    [
        ("strategy", "deepspeed_stage_3", "fabric-deepspeed"),
        ("strategy", "FSDP", "fabric-fsdp"),
        ("strategy", "ddp_spawn", "fabric-ddp"),
        ("strategy", "xla", "fabric-xla"),
        ("accelerator", "tpu", "fabric-xla"),
    ],
)
def test_name_of_a_missing_project_distribution_says_what_to_install(use_registry, kind, name, distribution, install_hint):
    use_registry()  # entry points off: none of the project's plugin distributions is loaded
    with pytest.raises(ValueError, match=install_hint(distribution)):
        Fabric(**{"accelerator": "cpu", kind: name})


def test_precision_of_a_missing_project_distribution_says_what_to_install(use_registry, install_hint):
    use_registry()
    with pytest.raises(ValueError, match=install_hint("fabric-amp")):
        Fabric(accelerator="cpu", precision="bf16-mixed")
