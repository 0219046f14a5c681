"""The decision hooks (``fabric_core.plugins.decisions``): each hook's answer reaches ``Fabric(...)``, the precedence
rule, failure isolation (and when a failure reaches the user), and tracing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from plugin_doubles import (
    AlwaysHereEnvironment,
    CountingCPUAccelerator,
    MarkerPrecision,
    RecordingLauncher,
    RecordingStrategy,
)

from fabric_core import Fabric
from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.io import CheckpointFormat
from fabric_core.plugins import FabricPluginWarning, Registry, hookimpl
from fabric_core.precision.full import FullPrecision
from fabric_core.strategies.single_device import SingleDeviceStrategy

REPO = Path(__file__).resolve().parents[3]


def test_hook_fabric_auto_accelerator(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_accelerators(self, registrar):
            registrar.add("counting_cpu", CountingCPUAccelerator)

        @hookimpl(tryfirst=True)
        def fabric_auto_accelerator(self, registry):
            assert isinstance(registry, Registry)
            return "counting_cpu"

    use_registry(Plugin())
    assert type(Fabric().accelerator) is CountingCPUAccelerator
    assert type(Fabric(accelerator="cpu").accelerator) is CPUAccelerator  # only "auto" asks the hook


def test_hook_fabric_auto_strategy(use_registry):
    calls = []

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl(tryfirst=True)
        def fabric_auto_strategy(self, registry, accelerator, num_devices, num_nodes, interactive):
            calls.append((type(accelerator), num_devices, num_nodes, interactive))
            return "recording" if num_devices == 2 else None

    use_registry(Plugin())
    fabric = Fabric(accelerator="cpu", devices=2)
    assert type(fabric.strategy) is RecordingStrategy
    assert calls == [(CPUAccelerator, 2, 1, False)]
    # Not answered by the plugin: the core's default answers for one device.
    assert type(Fabric(accelerator="cpu", devices=1).strategy) is SingleDeviceStrategy


def test_hook_fabric_select_precision(use_registry):
    seen = []

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl(tryfirst=True)
        def fabric_select_precision(self, registry, precision, strategy, accelerator):
            seen.append(precision)
            return MarkerPrecision() if isinstance(strategy, RecordingStrategy) else None

    use_registry(Plugin())
    fabric = Fabric(accelerator="cpu", strategy="recording", precision=32)
    assert type(fabric.strategy.precision) is MarkerPrecision
    assert seen == ["32-true"]  # the hook receives the canonical name, not the legacy spelling
    # For a strategy that is not the plugin's, it returns None and the core's default builds the registered one.
    assert (
        type(Fabric(accelerator="cpu", strategy="single_device", precision="32").strategy.precision)
        is FullPrecision
    )


def test_hook_fabric_detect_cluster_environment(use_registry):
    answer = AlwaysHereEnvironment()

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl(tryfirst=True)
        def fabric_detect_cluster_environment(self, registry):
            return answer

    use_registry(Plugin())
    assert Fabric(accelerator="cpu", strategy="recording").strategy.cluster_environment is answer


def test_hook_fabric_select_launcher(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl(tryfirst=True)
        def fabric_select_launcher(self, registry, strategy):
            return RecordingLauncher(strategy) if isinstance(strategy, RecordingStrategy) else None

    use_registry(Plugin())
    fabric = Fabric(accelerator="cpu", strategy="recording")
    assert type(fabric.strategy.launcher) is RecordingLauncher
    assert fabric.launch(lambda f: "ran") == "ran"
    assert len(fabric.strategy.launcher.launched) == 1
    assert (
        Fabric(accelerator="cpu").strategy.launcher is None
    )  # the core's default: no launcher for one device


def test_hook_fabric_report_packages(use_registry):
    """``fabric env`` lists what every plugin names, installed or not, and nothing of a plugin that is not loaded."""
    from fabric_core import cli_env

    class Plugin:
        @hookimpl
        def fabric_report_packages(self):
            return ["a-framework-not-installed-here", "pluggy"]

    use_registry(Plugin())
    packages = cli_env.related_packages()
    assert packages["a-framework-not-installed-here"] is None
    assert packages["pluggy"] is not None
    use_registry()
    assert "a-framework-not-installed-here" not in cli_env.related_packages()


def test_hook_fabric_report_services(use_registry):
    """``fabric env`` shows every plugin's service lines; one plugin raising becomes its own error line."""
    from fabric_core import cli_env

    class Reachable:
        @hookimpl
        def fabric_report_services(self):
            return {"Test cluster": "reachable at 10.0.0.1:1"}

    class Broken:
        @hookimpl
        def fabric_report_services(self):
            raise OSError("no route")

    use_registry(Reachable(), Broken())
    report = cli_env.collect()
    assert report["services"]["Test cluster"] == "reachable at 10.0.0.1:1"
    (broken,) = [state for label, state in report["services"].items() if label != "Test cluster"]
    assert broken == "error: OSError: no route"
    text = cli_env.format_report(report)
    assert "Services\n" in text and "Test cluster:" in text and "reachable at 10.0.0.1:1" in text
    use_registry()
    assert "Services\n" not in cli_env.format_report(cli_env.collect())  # no plugin reports one: no section


def _frame_in(folder: Path, package: str) -> Any:
    """The innermost frame of a call from ``folder/user.py`` into a module of ``package`` (a folder under ``folder``)."""
    inner = folder.joinpath(*package.split("."))
    inner.mkdir(parents=True)
    (inner / "wait.py").write_text("import sys\n\ndef wait():\n    return sys._getframe()\n")
    (folder / "user.py").write_text("def step(wait):\n    return wait()  # the user's line\n")
    namespace: dict[str, Any] = {}
    for name in ("wait", "user"):
        path = inner / "wait.py" if name == "wait" else folder / "user.py"
        exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["step"](namespace["wait"])


def test_hook_fabric_library_packages(use_registry, monkeypatch, tmp_path):
    """The hang report skips what installed plugins call library code, asked when hang detection starts; a
    ``"collective"`` package means the rank waits for the others. Without the answer, the frame is the user's."""
    from fabric_core.runtime import hang

    monkeypatch.setattr(hang, "_LIBRARIES", set(hang._LIBRARIES))
    monkeypatch.setattr(hang, "_WAITING_IN", set(hang._WAITING_IN))
    frame = _frame_in(tmp_path, "a_framework.comm")
    before, _, in_library = hang.describe_stack(frame, 0, 5.0, 1.0)
    assert "it is running" in before and "a_framework" in before and not in_library, before

    class Plugin:
        @hookimpl
        def fabric_library_packages(self):
            return {"a_framework": "library", "a_framework.comm": "collective"}

    use_registry(Plugin())
    monkeypatch.setenv("FABRIC_HANG_TIMEOUT", "3600")
    fabric = Fabric(accelerator="cpu", devices=1)
    try:
        fabric.launch(lambda _: None)  # the watchdog starts in the launched function's process and asks
    finally:
        hang.stop_watchdog()
    message, _, in_library = hang.describe_stack(frame, 0, 5.0, 1.0)
    assert in_library and "it is waiting in wait()" in message and "Another rank has probably stopped" in message
    assert f"called at {tmp_path / 'user.py'}:2 in step(): return wait()  # the user's line" in message, message

    with pytest.raises(ValueError, match=r"answered 'b_framework': 'waiting'; map an import package's name to"):
        hang.add_library_packages({"b_framework": "waiting"})


class MetaFolderFormat(CheckpointFormat):
    """A folder layout another program writes (``weights.pt`` + ``meta.json``): registered to be read, not written."""

    description = "a weights.pt + meta.json folder"
    seen: list = []

    def recognises(self, location):
        return location.child("meta.json").is_file()

    def write(self, location, state, context, *, filter=None, storage_options=None):
        raise NotImplementedError("read only")

    def read(self, location, map_location="cpu", weights_only=None):
        type(self).seen.append(weights_only)
        meta = json.loads(location.child("meta.json").read_text())
        return {"model": torch.load(location.path / "weights.pt", map_location=map_location), **meta}


def test_a_registered_format_is_asked_directly_by_a_strategy_that_does_not_own_it(use_registry, tmp_path):
    """A plugin-owned directory format is read whole by a strategy that does not know it, because the registered
    format itself says it recognises the folder (no reader hook in between)."""

    class Plugin:
        @hookimpl
        def fabric_register_checkpoint_formats(self, registrar):
            registrar.add("meta_folder", MetaFolderFormat)

    use_registry(Plugin())
    MetaFolderFormat.seen.clear()
    source = torch.nn.Linear(3, 2)
    folder = tmp_path / "sharded-like"
    folder.mkdir()
    torch.save(source.state_dict(), folder / "weights.pt")
    (folder / "meta.json").write_text(json.dumps({"step": 12}))

    fabric = Fabric(accelerator="cpu")
    assert "meta_folder" in [r.name for r in fabric.strategy.registered_formats]
    raw = fabric.strategy.read_checkpoint(folder)
    assert raw["step"] == 12 and torch.equal(raw["model"]["weight"], source.weight)

    target = torch.nn.Linear(3, 2)
    remainder = fabric.load(folder, {"model": target}, weights_only=False)
    assert remainder == {"step": 12} and MetaFolderFormat.seen == [None, False]  # weights_only reaches its read
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)

    # Single files are still read by the strategy's own single-file format.
    fabric.save(tmp_path / "plain.ckpt", {"model": source, "step": 3})
    assert fabric.load(tmp_path / "plain.ckpt", {"model": torch.nn.Linear(3, 2)}) == {"step": 3}


def test_hook_fabric_adjust_strategy(use_registry):
    calls = []

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)
            registrar.add("family_default", RecordingStrategy)

        @hookimpl
        def fabric_adjust_strategy(self, registry, strategy, accelerator, num_devices, num_nodes):
            calls.append((strategy, type(accelerator), num_devices, num_nodes))
            return "recording" if strategy == "family_default" else None

    use_registry(Plugin())
    fabric = Fabric(accelerator="cpu", strategy="Family_Default", devices=1)
    assert type(fabric.strategy) is RecordingStrategy
    assert calls == [("family_default", CPUAccelerator, 1, 1)]
    assert type(Fabric(accelerator="cpu", strategy="single_device").strategy) is SingleDeviceStrategy
    # A strategy object is used as it is: nothing to adjust.
    Fabric(accelerator="cpu", strategy=SingleDeviceStrategy())
    assert len(calls) == 2


def test_decision_precedence_is_the_load_order_within_tryfirst_plain_trylast(use_registry):
    """One rule for names and decisions: earlier in the load order first (here: the order of the extras)."""

    def plugin(answer: str, **marks: bool) -> Any:
        class Plugin:
            @hookimpl(**marks)
            def fabric_auto_accelerator(self, registry):
                return answer

        return Plugin()

    registry = use_registry(plugin("plain-early"), plugin("first-late", tryfirst=True), plugin("plain-late"))
    assert registry.decisions.auto_accelerator() == "first-late"
    registry = use_registry(plugin("plain-early"), plugin("plain-late"))
    assert registry.decisions.auto_accelerator() == "plain-early"  # pluggy alone would say "plain-late"
    registry = use_registry(plugin("last", trylast=True))
    assert registry.decisions.auto_accelerator() == "cpu"  # trylast too, but the core is earlier in the load order


class OwnStrategy(RecordingStrategy):
    """A strategy class from the plugin's own package (this test module)."""


def test_a_raising_decision_hook_is_skipped_unless_it_owns_the_decision(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", OwnStrategy)

        @hookimpl(tryfirst=True)
        def fabric_select_launcher(self, registry, strategy):
            raise RuntimeError("launcher hook broken")

        @hookimpl(tryfirst=True)
        def fabric_select_precision(self, registry, precision, strategy, accelerator):
            if isinstance(strategy, OwnStrategy):
                raise ValueError("recording runs only 64-true")  # its own strategy: the user must see this
            raise RuntimeError("precision hook broken")

    registry = use_registry(Plugin())
    with pytest.warns(FabricPluginWarning, match="fabric_select_launcher.*RuntimeError: launcher hook broken"):
        fabric = Fabric(accelerator="cpu", strategy="single_device")
    assert type(fabric.strategy.precision) is FullPrecision  # the core's default answered
    stages = {f.stage for f in registry.failures}
    assert {"hook fabric_select_launcher", "hook fabric_select_precision"} <= stages
    with pytest.raises(ValueError, match="recording runs only 64-true"):
        Fabric(accelerator="cpu", strategy="recording")


class OwnAccelerator(CPUAccelerator):
    """An accelerator class from the plugin's own package (this test module)."""

    name = "own"


def test_a_raising_decision_hook_about_its_own_accelerator_reaches_the_user(use_registry):
    """The rule covers accelerators too: an XLA-like plugin refuses strategies its devices cannot run."""

    class Plugin:
        @hookimpl
        def fabric_register_accelerators(self, registrar):
            registrar.add("own", OwnAccelerator)

        @hookimpl(tryfirst=True)
        def fabric_adjust_strategy(self, registry, strategy, accelerator, num_devices, num_nodes):
            if isinstance(accelerator, OwnAccelerator):
                raise ValueError("the own accelerator runs only its own strategies")
            raise RuntimeError("adjust hook broken")

    registry = use_registry(Plugin())
    with pytest.raises(ValueError, match="runs only its own strategies"):
        Fabric(accelerator="own", strategy="single_device")
    with pytest.warns(FabricPluginWarning, match="adjust hook broken"):
        fabric = Fabric(accelerator="cpu", strategy="single_device")  # about the core's accelerator: skipped
    assert type(fabric.strategy) is SingleDeviceStrategy
    assert "hook fabric_adjust_strategy" in {f.stage for f in registry.failures}


def test_registration_calls_are_traced(use_registry, monkeypatch, capsys):
    monkeypatch.setenv("FABRIC_TRACE_HOOKS", "1")

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

    use_registry(Plugin())
    Fabric(accelerator="cpu", strategy="recording")
    err = capsys.readouterr().err
    assert "[fabric hooks] fabric_register_strategies: Plugin registered recording" in err
    assert "[fabric hooks] fabric_register_strategies: fabric-core registered single_device" in err
    assert re.search(r"fabric_select_launcher\(strategy=.*\) -> None \(no plugin answered\)", err)


def test_an_environment_detected_by_variables_is_imported_only_where_one_is_set(use_registry, monkeypatch):
    """``detected_by``: where none of its variables is set, detection neither imports nor asks the environment."""

    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl
        def fabric_register_environments(self, registrar):
            registrar.add("gated", "plugin_doubles:AlwaysHereEnvironment", detected_by=("MY_SCHEDULER_JOB",))

    monkeypatch.delenv("MY_SCHEDULER_JOB", raising=False)
    registry = use_registry(Plugin())
    (entry,) = [e for e in registry.entries("environment") if e.name == "gated"]
    detected = Fabric(accelerator="cpu", strategy="recording").strategy.cluster_environment
    assert detected is not None and type(detected).__name__ != "AlwaysHereEnvironment"
    assert not entry.is_loaded  # not even imported

    monkeypatch.setenv("MY_SCHEDULER_JOB", "17")
    detected = Fabric(accelerator="cpu", strategy="recording").strategy.cluster_environment
    assert type(detected) is AlwaysHereEnvironment
    assert entry.is_loaded


@pytest.mark.parametrize(
    ("kind_hook", "detected_by", "message"),
    [
        ("fabric_register_strategies", ("X",), "`detected_by` is for cluster environments"),
        ("fabric_register_environments", "MY_VAR", "takes variable names"),
    ],
)
def test_detected_by_is_refused_where_it_cannot_mean_anything(use_registry, kind_hook, detected_by, message):
    class Plugin:
        pass

    def register(self, registrar):
        registrar.add("thing", AlwaysHereEnvironment, detected_by=detected_by)

    setattr(Plugin, kind_hook, hookimpl(register))
    with pytest.warns(FabricPluginWarning, match=message):  # a failing registration is reported, not raised
        use_registry(Plugin())
