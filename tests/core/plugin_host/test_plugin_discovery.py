"""Discovery (``fabric_core.plugins.discovery``) of real installed distributions: laziness, the load order, broken
plugins, conflicts, the switches, validation, and ``fabric plugins --check``.

The example plugin and the throwaway distributions in ``tests/core/plugin_fixtures`` are pip-installed into a
private directory (the ``plugin_sites`` fixture, see ``tests/conftest.py``) and checked in a subprocess, because
entry points only exist for installed distributions.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from plugin_doubles import (
    last_json_line,
)

REPO = Path(__file__).resolve().parents[3]


def test_hook_fabric_register_strategies_installed_distribution_resolves_and_trains(plugin_sites):
    """The example plugin, really pip-installed: listed without importing it, resolved by name, observable."""
    code = textwrap.dedent(
        """
        import json, sys
        import torch
        from fabric_core.plugins import get_registry
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
    result = last_json_line(done.stdout)
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


def test_discovery_is_lazy(plugin_sites):
    """Listing names (registry or `fabric plugins`) does not import the plugin's implementation modules.

    Building the registry does not even import torch, for any installed plugin (the project's own plugin
    distributions installed in the venv are visible here too). ``test_cli`` checks the same for ``--help``.
    """
    code = textwrap.dedent(
        """
        import json, sys
        from fabric_core.cli import main
        from fabric_core.plugins import get_registry
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
    after_registry, after_listing, after_check = last_json_line(done.stdout)
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
        from fabric_core.plugins import FabricPluginWarning, PluginImportError, get_registry
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
    result = last_json_line(done.stdout)
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
        from fabric_core.plugins import FabricPluginWarning, get_registry
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
    result = last_json_line(done.stdout)
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
    result = last_json_line(done.stdout)
    assert result["accelerator"] == "cpu" and result["strategy"] == "SingleDeviceStrategy"
    assert "no installed plugin recognises it as a checkpoint" in result["load_error"]
    joined = "\n".join(result["warnings"])
    assert "fabric-exits-at-import 2.0.0" in joined and "SystemExit: 3" in joined
    for hook in ("fabric_auto_accelerator", "fabric_auto_strategy", "fabric_select_precision",
                 "fabric_detect_cluster_environment", "fabric_select_launcher"):  # fmt: skip
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
    warned = plugin_sites.python("strict", "from fabric_core.plugins import get_registry; get_registry()", env=env)
    assert "FABRIC_DISABLE_PLUGINS names 'no_such_plugin', but no installed Fabric plugin has that" in warned.stderr
    allow = plugin_sites.python(
        "strict",
        "from fabric_core.plugins import get_registry; get_registry()",
        env={"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1", "FABRIC_PLUGINS": "exampel"},
    )
    assert "FABRIC_PLUGINS names 'exampel'" in allow.stderr and "example (fabric-example-plugin)" in allow.stderr


def test_fabric_plugins_reports_a_name_that_no_installed_plugin_has(plugin_sites):
    """What `Fabric()` warns about, `fabric plugins` shows too (it used to swallow the warning): in the table and in
    the JSON, for FABRIC_PLUGINS (with autoload off) and FABRIC_DISABLE_PLUGINS."""
    env = {"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1", "FABRIC_PLUGINS": "fabric-example-plugin,exampel", "FABRIC_DISABLE_PLUGINS": "nothing_here"}
    done = plugin_sites.run("example", ["fabric", "plugins", "--json"], env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["unknown_names"] == [
        {"variable": "FABRIC_PLUGINS", "name": "exampel"},
        {"variable": "FABRIC_DISABLE_PLUGINS", "name": "nothing_here"},
    ]
    table = plugin_sites.run("example", ["fabric", "plugins"], env=env)
    assert table.returncode == 0, table.stderr
    assert "FABRIC_PLUGINS names 'exampel', but no installed Fabric plugin has that" in table.stdout
    assert "FABRIC_DISABLE_PLUGINS names 'nothing_here'" in table.stdout
    assert "example_single" in table.stdout  # the allowed name still loads
    quiet = plugin_sites.run("example", ["fabric", "plugins", "--json"], env={"FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert json.loads(quiet.stdout)["unknown_names"] == []

def test_first_party_names_are_not_taken_silently(plugin_sites):
    pytest.importorskip("fabric_ddp", reason="the venv's fabric-ddp is the first party here (not in the XLA lane)")
    code = textwrap.dedent(
        """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from fabric_core.plugins import get_registry
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
    result = last_json_line(done.stdout)
    assert result["ddp"] == "fabric-ddp" and result["squatter_single"] == "fabric-aaa-squatter"
    assert result["error"] is None
    assert any("'ddp' registered by fabric-aaa-squatter is ignored: fabric-ddp has it" in w for w in result["warnings"])


_KEYED_FORMAT_JOB = '''
import json, sys
import torch
from fabric_core import Fabric
from fabric_core.plugins import get_registry

folder, out = sys.argv[1], sys.argv[2]
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
torch.manual_seed(0)
model = fabric.setup(torch.nn.Linear(3, 2))
registry = get_registry()
lazy = "fabric_keyed_format.format" not in sys.modules
keyed = registry.create("checkpoint_format", "keyed_folder")
fabric.strategy.save_checkpoint(folder, {"model": model, "step": 7}, checkpoint_format=keyed)
fabric.barrier()
# The strategy's own formats do not know the folder: the registered format that recognises it reads it.
fresh = torch.nn.Linear(3, 2)
remainder = fabric.load(folder, {"model": fresh})
if fabric.is_global_zero:
    with open(out, "w") as file:
        json.dump({
            "lazy_until_created": lazy,
            "distribution": registry.get("checkpoint_format", "keyed_folder").distribution,
            "strategy": type(fabric.strategy).__module__,
            "remainder": remainder,
            "same_weights": torch.equal(fresh.weight, model.module.weight),
        }, file)
'''


@pytest.mark.multiprocess
def test_hook_fabric_register_checkpoint_formats_installed_format_used_by_a_strategy_it_does_not_own(plugin_sites, tmp_path):
    """fabric-keyed-format registers a checkpoint format and no strategy. Really pip-installed, it is written by
    DDP (two processes, the core's folder commit) and loaded back by ``fabric.load`` without naming it; then
    ``fabric consolidate`` reads the folder through the same registration."""
    from jobs import read_json, run_script

    pytest.importorskip("fabric_ddp", reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    site = plugin_sites.site("formats")
    script = tmp_path / "keyed_job.py"
    script.write_text(_KEYED_FORMAT_JOB)
    folder, out = tmp_path / "keyed-ckpt", tmp_path / "result.json"
    run_script(script, str(folder), str(out), tmp_path=tmp_path, timeout=180, env={"PYTHONPATH": str(site)})
    assert read_json(out) == {
        "lazy_until_created": True,
        "distribution": "fabric-keyed-format",
        "strategy": "fabric_ddp.strategy",
        "remainder": {"step": 7},
        "same_weights": True,
    }
    assert sorted(p.name for p in folder.iterdir()) == ["keys.json", "model.pt", "step.pt"]

    done = plugin_sites.run("formats", ["fabric", "consolidate", str(folder)])
    assert done.returncode == 0, done.stderr
    import torch

    single = torch.load(tmp_path / "keyed-ckpt.consolidated", weights_only=True)
    assert single["step"] == 7 and set(single["model"]) == {"weight", "bias"}
