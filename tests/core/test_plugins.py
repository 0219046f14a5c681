"""Plugin mechanics: every hook, discovery of real installed distributions, failures, conflicts, switches.

Two kinds of tests live here:

* **Installed distributions** (``plugin_sites`` fixture, see ``tests/conftest.py``): the example plugin and the
  throwaway distributions in ``tests/core/plugin_fixtures`` are pip-installed into a private directory and
  checked in a subprocess, because entry points only exist for installed distributions.
* **Hooks** (``use_registry`` fixture): a plugin object is registered through pluggy with
  ``build_registry(extra_plugins=...)`` and installed as the process-wide registry for one test only, with
  entry-point autoload off so the result does not depend on what else is installed in the venv.

Every hook in :mod:`fabric_core.hookspecs` must have a test named ``test_hook_<hook name>...`` (checked below).
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric_core import Fabric, hookspecs
from fabric_core import registry as registry_module
from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.environments.plain import PlainEnvironment
from fabric_core.hookspecs import hookimpl
from fabric_core.launchers.base import Launcher
from fabric_core.precision.base import Precision
from fabric_core.precision.double import DoublePrecision
from fabric_core.precision.full import FullPrecision
from fabric_core.registry import FabricPluginWarning, Registry, build_registry
from fabric_core.strategies.single_device import SingleDeviceStrategy

REPO = Path(__file__).resolve().parents[2]
HOOK_NAMES = sorted(
    name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")
)


@pytest.fixture
def use_registry(monkeypatch: pytest.MonkeyPatch):
    """Make a registry of the built-ins plus ``plugins`` the process-wide one, for this test only."""

    def install(*plugins: Any) -> Registry:
        monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
        monkeypatch.delenv("FABRIC_PLUGINS", raising=False)
        registry = build_registry(extra_plugins=plugins)
        # monkeypatch puts the previous (unmodified) registry back afterwards.
        monkeypatch.setattr(registry_module, "_registry", registry)
        return registry

    return install


def _last_json_line(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- meta-tests


def test_hookspecs_module_declares_the_expected_hooks():
    assert len(HOOK_NAMES) >= 12
    assert {
        "fabric_register_strategies",
        "fabric_auto_accelerator",
        "fabric_adjust_strategy",
        "fabric_select_checkpoint_reader",
    } <= set(HOOK_NAMES)
    assert set(hookspecs.HOOK_NAMES) == set(HOOK_NAMES)


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hookspec_has_a_docstring(hook_name):
    doc = inspect.getdoc(getattr(hookspecs, hook_name))
    assert doc and len(doc.split()) >= 10, f"{hook_name} needs a docstring that states its contract"


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_has_a_test(hook_name):
    tests = [name for name in globals() if name.startswith(f"test_hook_{hook_name}")]
    assert tests, f"write a test named test_hook_{hook_name}... in this module"


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_is_documented_with_its_signature(hook_name):
    docs = (REPO / "docs" / "plugins.md").read_text()
    params = ", ".join(inspect.signature(getattr(hookspecs, hook_name)).parameters)
    assert f"### `{hook_name}({params})`" in docs


# ---------------------------------------------------------------------------------------------------- test plugins


class CountingCPUAccelerator(CPUAccelerator):
    name = "counting_cpu"


class RecordingStrategy(SingleDeviceStrategy):
    """Keeps the cluster environment it is attached with (the single-device strategy does not need one), and
    accepts any number of devices (it computes on the first), so it can stand in for a multi-device answer."""

    def attach(self, *, cluster_environment: Any = None, devices: Any = (), **kwargs: Any) -> None:
        super().attach(cluster_environment=cluster_environment, devices=list(devices)[:1], **kwargs)
        self.cluster_environment = cluster_environment


class RecordingLauncher(Launcher):
    is_interactive_compatible = True

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.launched: list[Any] = []

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        self.launched.append(function)
        return function(*args, **kwargs)


class NeedsLauncherStrategy(SingleDeviceStrategy):
    launcher_name = "recording"


class MarkerPrecision(Precision):
    precision = "32-true"


class AlwaysHereEnvironment(PlainEnvironment):
    name = "always_here"
    detect_priority = -1  # before torchelastic, SLURM, ... and the plain fallback

    @classmethod
    def detect(cls) -> bool:
        return True


# ---------------------------------------------------------------------------------------------------- registration hooks


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


def test_hook_fabric_register_strategies_installed_distribution_resolves_and_trains(plugin_sites):
    """The example plugin, really pip-installed: listed without importing it, resolved by name, observable."""
    code = textwrap.dedent(
        """
        import json, sys
        import torch
        from fabric_core.registry import get_registry
        entry = get_registry().get("strategy", "example_single")
        lazy = "fabric_example_plugin.strategy" not in sys.modules
        from fabric_core import Fabric
        fabric = Fabric(accelerator="cpu", strategy="Example_Single", devices=1)
        model = torch.nn.Linear(2, 1)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            fabric.backward(model(torch.ones(4, 2)).sum())
            optimizer.step()
            optimizer.zero_grad()
        print(json.dumps({
            "lazy": lazy,
            "distribution": entry.distribution,
            "version": entry.version,
            "strategy": type(fabric.strategy).__module__ + ":" + type(fabric.strategy).__name__,
            "steps": fabric.strategy.optimizer_steps,
        }))
        """
    )
    done = plugin_sites.python("example", code, env={"FABRIC_TRACE_HOOKS": "1"})
    assert done.returncode == 0, done.stderr
    result = _last_json_line(done.stdout)
    assert result == {
        "lazy": True,
        "distribution": "fabric-example-plugin",
        "version": "0.3.1",
        "strategy": "fabric_example_plugin.strategy:StepCountingStrategy",
        "steps": 3,
    }
    # FABRIC_TRACE_HOOKS=1 prints every registration and decision, with who made it.
    assert "[fabric hooks] fabric_register_strategies: fabric-example-plugin registered example_single" in done.stderr
    assert re.search(r"fabric_select_precision\(.*\) -> .*\(answered by fabric-core", done.stderr)
    assert "fabric_select_launcher(" in done.stderr


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


# ---------------------------------------------------------------------------------------------------- decision hooks


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


def test_auto_strategy_without_a_parallel_plugin_names_the_distribution(use_registry, install_hint):
    use_registry()
    with pytest.raises(ValueError, match=install_hint("fabric-ddp")):
        Fabric(accelerator="cpu", devices=2)


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


def test_default_environment_detection_without_plugins(use_registry):
    use_registry()
    env = Fabric(accelerator="cpu", strategy=RecordingStrategy()).strategy.cluster_environment
    assert type(env) is PlainEnvironment


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


def test_hook_fabric_select_checkpoint_reader(use_registry, tmp_path):
    """A plugin-owned directory format is read through the hook, by a strategy that does not know it."""
    seen = []

    def load_directory(path: Path, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        seen.append(weights_only)
        meta = json.loads((path / "meta.json").read_text())
        return {"model": torch.load(path / "weights.pt", map_location=map_location), **meta}

    class Plugin:
        @hookimpl(tryfirst=True)
        def fabric_select_checkpoint_reader(self, path):
            return load_directory if (path / "meta.json").is_file() else None

    use_registry(Plugin())
    source = torch.nn.Linear(3, 2)
    folder = tmp_path / "sharded-like"
    folder.mkdir()
    torch.save(source.state_dict(), folder / "weights.pt")
    (folder / "meta.json").write_text(json.dumps({"step": 12}))

    fabric = Fabric(accelerator="cpu")
    raw = fabric.strategy.read_checkpoint(folder)
    assert raw["step"] == 12 and torch.equal(raw["model"]["weight"], source.weight)

    target = torch.nn.Linear(3, 2)
    remainder = fabric.load(folder, {"model": target}, weights_only=False)
    assert remainder == {"step": 12} and seen == [None, False]  # weights_only reaches the reader
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)

    # Single files are still read by the core's checkpoint I/O.
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


def test_a_raising_decision_hook_is_skipped_unless_it_owns_the_decision(use_registry):
    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("recording", RecordingStrategy)

        @hookimpl(tryfirst=True)
        def fabric_select_launcher(self, registry, strategy):
            raise RuntimeError("launcher hook broken")

        @hookimpl(tryfirst=True)
        def fabric_select_precision(self, registry, precision, strategy, accelerator):
            if isinstance(strategy, RecordingStrategy):
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


# ---------------------------------------------------------------------------------------------------- real installs


def test_discovery_is_lazy(plugin_sites):
    """Listing names (registry or `fabric plugins`) does not import the plugin's implementation modules.

    Building the registry does not even import torch, for any installed plugin (the project's own plugin
    distributions installed in the venv are visible here too). ``test_cli`` checks the same for ``--help``.
    """
    code = textwrap.dedent(
        """
        import json, sys
        from fabric_core.cli import main
        from fabric_core.registry import get_registry
        registry = get_registry()
        after_registry = sorted(m for m in ("fabric_example_plugin.register", "fabric_example_plugin.strategy",
                                            "fabric_example_plugin.precision", "torch") if m in sys.modules)
        assert main(["plugins"]) == 0
        assert main(["plugins", "--json"]) == 0
        after_listing = any(m.startswith("fabric_example_plugin.") and m != "fabric_example_plugin.register"
                            for m in sys.modules)
        assert main(["plugins", "--check"]) == 0
        after_check = "fabric_example_plugin.strategy" in sys.modules
        print(json.dumps([after_registry, after_listing, after_check]))
        """
    )
    done = plugin_sites.python("example", code)
    assert done.returncode == 0, done.stderr
    after_registry, after_listing, after_check = _last_json_line(done.stdout)
    assert after_registry == ["fabric_example_plugin.register"]
    assert after_listing is False
    assert after_check is True  # --check does import it, so the flags above can detect an import


def test_installed_plugin_is_listed_by_the_console_script(plugin_sites):
    done = plugin_sites.run("example", ["fabric", "plugins", "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    entries = {(e["kind"], e["name"]): e for e in report["entries"]}
    strategy = entries[("strategy", "example_single")]
    assert strategy["distribution"] == "fabric-example-plugin" and strategy["version"] == "0.3.1"
    assert strategy["aliases"] == ["example_counting"]
    assert (
        strategy["status"] == "not checked"
        and strategy["target"] == "fabric_example_plugin.strategy:StepCountingStrategy"
    )
    assert entries[("precision", "example-64")]["distribution"] == "fabric-example-plugin"
    assert entries[("strategy", "single_device")]["distribution"] == "fabric-core"
    # Only names: the venv's own plugin distributions are visible too and are not this test's business.
    assert "fabric-example-plugin" not in json.dumps([report["failures"], report["conflicts"]])


def test_broken_plugins_are_reported_and_do_not_affect_other_names(plugin_sites):
    code = textwrap.dedent(
        """
        import json, warnings
        from fabric_core.registry import FabricPluginWarning, PluginImportError, get_registry
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry = get_registry()
        from fabric_core import Fabric
        result = {
            "warnings": [str(w.message) for w in caught if issubclass(w.category, FabricPluginWarning)],
            "failures": [[f.distribution, f.version, type(f.error).__name__, str(f.error)] for f in registry.failures],
            "example": type(Fabric(accelerator="cpu", strategy="example_single").strategy).__name__,
            "good_target": type(Fabric(accelerator="cpu", strategy="good_target").strategy).__name__,
            "hook_raises_cpu": "hook_raises_cpu" in registry.names("accelerator"),
        }
        try:
            Fabric(accelerator="cpu", strategy="bad_target")
        except PluginImportError as err:
            result["bad_target"] = str(err)
        try:
            Fabric(accelerator="cpu", strategy="nonexistent")
        except ValueError as err:
            result["unknown"] = str(err)
        print(json.dumps(result))
        """
    )
    done = plugin_sites.python("zoo", code)
    assert done.returncode == 0, done.stderr
    result = _last_json_line(done.stdout)
    failures = {f[0]: f for f in result["failures"]}
    # The registration module cannot be imported: distribution, version and the error are recorded.
    assert failures["fabric-broken-import"][1:3] == ["1.0.0", "ModuleNotFoundError"]
    assert "fabric_missing_dependency_for_tests" in failures["fabric-broken-import"][3]
    # A registration hook raised: recorded too; the same plugin's other hook still registered its name.
    assert failures["fabric-hook-raises"][1:] == ["2.0.0", "RuntimeError", "registration exploded on purpose"]
    assert result["hook_raises_cpu"] is True
    assert any("fabric-broken-import 1.0.0" in w for w in result["warnings"])
    assert any("fabric-hook-raises 2.0.0" in w for w in result["warnings"])
    # A target module that fails only breaks its own name, and says who provides it.
    assert result["good_target"] == "GoodStrategy" and result["example"] == "StepCountingStrategy"
    assert "fabric-bad-target 0.5.0" in result["bad_target"]
    assert "fabric_missing_backend_for_tests" in result["bad_target"]
    # An unknown name mentions the broken plugins, since one of them may have provided it.
    assert "fabric-broken-import 1.0.0" in result["unknown"]


def test_fabric_plugins_check_reports_broken_targets(plugin_sites):
    done = plugin_sites.run("zoo", ["fabric", "plugins", "--json", "--check", "--kind", "strategy"])
    assert done.returncode == 1, "`--check` must fail when something is broken"
    report = json.loads(done.stdout)
    status = {e["name"]: (e["status"], e["error"]) for e in report["entries"]}
    assert (
        status["bad_target"][0] == "error" and "fabric_missing_backend_for_tests" in status["bad_target"][1]
    )
    assert status["good_target"] == ("available", None) and status["example_single"] == ("available", None)
    assert {"fabric-broken-import", "fabric-hook-raises"} <= {f["distribution"] for f in report["failures"]}
    assert "FabricPluginWarning" not in done.stderr, "failures belong in the report, not in Python warnings"


def test_name_conflicts_first_registration_wins_unless_override(plugin_sites):
    code = textwrap.dedent(
        """
        import json, warnings
        from fabric_core.registry import FabricPluginWarning, get_registry
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry = get_registry()
        print(json.dumps({
            "twin": [registry.get("strategy", "twin").distribution, registry.get("strategy", "twin").load().origin],
            "replaced": [registry.get("strategy", "replaced").distribution,
                         registry.get("strategy", "replaced").load().origin],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, FabricPluginWarning)],
        }))
        """
    )
    done = plugin_sites.python("zoo", code)
    assert done.returncode == 0, done.stderr
    result = _last_json_line(done.stdout)
    # Installed b before a, but distributions register in alphabetical order: a is first and keeps 'twin'.
    assert result["twin"] == ["fabric-conflict-a", "a"]
    # b registered 'replaced' with override=True: the later registration wins.
    assert result["replaced"] == ["fabric-conflict-b", "b"]
    twin = [w for w in result["warnings"] if "'twin'" in w]
    replaced = [w for w in result["warnings"] if "'replaced'" in w]
    assert (
        len(twin) == 1
        and "registered by fabric-conflict-b is ignored: fabric-conflict-a has it" in twin[0]
        and "first registration wins" in twin[0]
    )
    assert len(replaced) == 1 and "override=True" in replaced[0]


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


@pytest.mark.parametrize(
    ("env", "expected_example", "expect_failures"),
    [
        ({}, True, True),
        ({"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1"}, False, False),
        ({"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1", "FABRIC_PLUGINS": "example"}, True, False),
        (
            {"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "true", "FABRIC_PLUGINS": "Fabric_Example_Plugin, other"},
            True,
            False,
        ),
    ],
    ids=["autoload", "disabled", "allow-entry-point-name", "allow-distribution-name"],
)
def test_autoload_switch(plugin_sites, env, expected_example, expect_failures):
    done = plugin_sites.run("zoo", ["fabric", "plugins", "--json"], env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    distributions = {e["distribution"] for e in report["entries"]}
    assert ("fabric-example-plugin" in distributions) is expected_example
    assert bool(report["failures"]) is expect_failures  # the broken plugins were not even imported
    if env:
        # Only the allowed entry point (or none) was loaded: the conflicting distributions are absent, and
        # `fabric plugins` says they are installed but not loaded.
        assert distributions <= {"fabric-core", "fabric-example-plugin"}
        assert {"fabric-conflict-a", "fabric-broken-import"} <= set(report["not_loaded"])
        assert ("fabric-example-plugin" in report["not_loaded"]) is not expected_example
    else:
        assert report["not_loaded"] == []


PARALLEL_EXAMPLE = textwrap.dedent(
    """
    import json
    import sys
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from fabric_core import Fabric
    from fabric_core import registry as registry_module
    from fabric_core.hookspecs import hookimpl
    from fabric_core.strategies import ParallelStrategy


    class AveragingStrategy(ParallelStrategy):
        def setup_module(self, module):
            return DistributedDataParallel(module, bucket_cap_mb=8)

        def unwrap_module(self, module):
            return module.module if isinstance(module, DistributedDataParallel) else module


    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("averaging", AveragingStrategy)


    # Every rank (the launcher re-runs this script) registers the plugin the same way.
    registry_module._registry = registry_module.build_registry(extra_plugins=(Plugin(),))
    fabric = Fabric(accelerator="cpu", strategy="averaging", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.full((2, 4), float(fabric.global_rank + 1))
    fabric.backward(model(x).sum())
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    import sys
    from pathlib import Path

    Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps({"rank": fabric.global_rank,
        "world": fabric.world_size, "sum": total.item(), "grad": model.module.weight.grad.tolist(),
        "strategy": type(fabric.strategy).__name__}))
    """
)


def test_documented_parallel_strategy_example_runs_two_processes(tmp_path):
    """docs/plugins.md's ParallelStrategy example: two real processes, gradients averaged by DDP."""
    import os
    import socket
    import subprocess
    import sys

    script = tmp_path / "averaging.py"
    script.write_text(PARALLEL_EXAMPLE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "TORCHELASTIC_", "SLURM_"))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in rows] == [0, 1] and {r["world"] for r in rows} == {2}
    assert {r["strategy"] for r in rows} == {"AveragingStrategy"} and {r["sum"] for r in rows} == {1.0}
    assert rows[0]["grad"] == rows[1]["grad"] == [[3.0, 3.0, 3.0, 3.0]]  # mean of 2*1 and 2*2 per weight


def test_a_misspelled_hook_rejects_the_plugin_at_discovery(plugin_sites):
    done = plugin_sites.run("strict", ["fabric", "plugins", "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    typo = [f for f in report["failures"] if f["distribution"] == "fabric-hook-typo"]
    assert len(typo) == 1 and typo[0]["version"] == "2.0.0" and typo[0]["stage"] == "validation"
    assert "'fabric_register_strategy', which is not a Fabric hook" in typo[0]["error"]
    assert "Did you mean 'fabric_register_strategies'?" in typo[0]["error"]
    names = {e["name"] for e in report["entries"]}
    assert "typo_cpu" not in names and "example_single" in names  # rejected as a whole; others unaffected


STRICT_CODE = textwrap.dedent(
    """
    import json, tempfile, warnings
    from pathlib import Path
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fabric_core import Fabric
        fabric = Fabric(devices=1)  # auto accelerator, auto strategy, environment, precision, launcher: all raise
        module = torch.nn.Linear(2, 1)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        folder = Path(tempfile.mkdtemp())
        try:
            fabric.load(folder, {"model": model})
            load_error = None
        except ValueError as err:
            load_error = str(err)
    print(json.dumps({
        "accelerator": fabric.accelerator.name,
        "strategy": type(fabric.strategy).__name__,
        "load_error": load_error,
        "warnings": [str(w.message) for w in caught if "Plugin" in w.category.__name__],
    }))
    """
)


def test_broken_plugins_do_not_break_names_they_do_not_own(plugin_sites):
    """sys.exit() at import, and decision hooks that raise: Fabric() still works, each failure is named."""
    done = plugin_sites.python("strict", STRICT_CODE)
    assert done.returncode == 0, done.stderr
    result = _last_json_line(done.stdout)
    assert result["accelerator"] == "cpu" and result["strategy"] == "SingleDeviceStrategy"
    assert "no installed plugin recognises it as a checkpoint" in result["load_error"]
    joined = "\n".join(result["warnings"])
    assert "fabric-exits-at-import 2.0.0" in joined and "SystemExit: 3" in joined
    for hook in ("fabric_auto_accelerator", "fabric_auto_strategy", "fabric_select_precision",
                 "fabric_detect_cluster_environment", "fabric_select_launcher", "fabric_select_checkpoint_reader"):  # fmt: skip
        assert f"fabric-raising-decisions 2.0.0 (plugin 'raising_decisions', hook {hook})" in joined, hook


def test_fabric_plugins_check_runs_decision_hooks_and_flags_heavy_registration_modules(plugin_sites):
    done = plugin_sites.run("strict", ["fabric", "plugins", "--check", "--json"])
    assert done.returncode == 1, done.stderr  # broken plugins and a heavy registration module
    report = json.loads(done.stdout)
    stages = {(f["distribution"], f["stage"]) for f in report["failures"]}
    assert ("fabric-exits-at-import", "import") in stages
    assert ("fabric-raising-decisions", "hook fabric_select_launcher") in stages
    assert ("fabric-raising-decisions", "hook fabric_detect_cluster_environment") in stages
    heavy = {p["distribution"]: p["heavy_imports"] for p in report["plugins"]}
    assert "torch.distributed" in heavy["fabric-heavy-register"] and heavy["fabric-example-plugin"] == []
    answering = {p["distribution"]: p["decision_hooks"] for p in report["plugins"]}
    assert "fabric_select_launcher" in answering["fabric-raising-decisions"]
    table = plugin_sites.run("strict", ["fabric", "plugins", "--check"]).stdout
    assert "Registration modules that import heavy modules" in table and "fabric-heavy-register" in table


def test_one_plugin_is_switched_off_by_name(plugin_sites):
    env = {"FABRIC_DISABLE_PLUGINS": "exits_at_import, fabric-raising-decisions,no_such_plugin"}
    done = plugin_sites.run("strict", ["fabric", "plugins", "--json"], env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"fabric-exits-at-import", "fabric-raising-decisions"} <= set(report["blocked"])
    assert not {"fabric-exits-at-import", "fabric-raising-decisions"} & {f["distribution"] for f in report["failures"]}
    warned = plugin_sites.python("strict", "from fabric_core.registry import get_registry; get_registry()", env=env)
    assert "FABRIC_DISABLE_PLUGINS names 'no_such_plugin', but no installed Fabric plugin has that" in warned.stderr
    allow = plugin_sites.python(
        "strict",
        "from fabric_core.registry import get_registry; get_registry()",
        env={"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1", "FABRIC_PLUGINS": "exampel"},
    )
    assert "FABRIC_PLUGINS names 'exampel'" in allow.stderr and "example (fabric-example-plugin)" in allow.stderr


def test_first_party_names_are_not_taken_silently(plugin_sites):
    pytest.importorskip("fabric_ddp", reason="the venv's fabric-ddp is the first party here (not in the XLA lane)")
    code = textwrap.dedent(
        """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from fabric_core.registry import get_registry
            registry = get_registry()
        try:
            from fabric_core import Fabric
            Fabric(accelerator="cpu", strategy="ddp", devices=1)
            error = None
        except ValueError as err:
            error = str(err)
        entry = registry.lookup("strategy", "ddp")
        print(json.dumps({
            "ddp": entry.distribution if entry else None,
            "squatter_single": registry.get("strategy", "squatter_single").distribution,
            "error": error,
            "warnings": [str(w.message) for w in caught],
        }))
        """
    )
    # fabric-ddp (installed in the venv) loads before third parties, whatever their names.
    done = plugin_sites.python("strict", code)
    assert done.returncode == 0, done.stderr
    result = _last_json_line(done.stdout)
    assert result["ddp"] == "fabric-ddp" and result["squatter_single"] == "fabric-aaa-squatter"
    assert result["error"] is None
    assert any("'ddp' registered by fabric-aaa-squatter is ignored: fabric-ddp has it" in w for w in result["warnings"])


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


# ---------------------------------------------------------------------------------------------------- resolution errors


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
