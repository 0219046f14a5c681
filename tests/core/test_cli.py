"""The ``fabric`` command line: help, ``fabric plugins`` (table and JSON), ``python -m fabric_core``.

Listings of really installed plugin distributions run the pip-generated console script in a subprocess
(``plugin_sites`` fixture); formatting details are checked in-process on registries built from test plugins.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from importlib.metadata import distribution

import pytest

from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.cli import collect_plugins, format_table, main
from fabric_core.plugins import FabricPluginWarning, build_registry, hookimpl
from fabric_core.precision.full import FullPrecision


def _rows(table: str) -> dict[tuple[str, str], list[str]]:
    """Table rows keyed by (kind, name); columns are separated by two or more spaces."""
    rows = {}
    for line in table.splitlines()[1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[(cells[0], cells[1])] = cells
    return rows


def test_console_script_is_declared_by_fabric_core():
    scripts = [ep for ep in distribution("fabric-core").entry_points if ep.group == "console_scripts"]
    # `fabric-core` too: lightning-fabric installs a `fabric` script as well (docs/migrating.md, "The command line")
    assert sorted((ep.name, ep.value) for ep in scripts) == [("fabric", "fabric_core.cli:main"), ("fabric-core", "fabric_core.cli:main")]


def test_help_lists_the_commands_without_importing_torch():
    code = textwrap.dedent(
        """
        import sys
        from fabric_core.cli import main
        try:
            main(["--help"])
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        assert "torch" not in sys.modules, "fabric --help must stay fast: it imported torch"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: fabric ")
    for command in ("plugins", "run", "consolidate"):
        assert re.search(rf"^\s+{command}\b", done.stdout, re.MULTILINE), command


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: fabric" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(r"fabric \(fabric-core\) \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_run_and_consolidate_are_wired(capsys):
    assert main(["run", "--help"]) == 0
    assert "Usage: fabric run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["consolidate", "--help"])
    assert info.value.code == 0
    assert "usage: fabric consolidate" in capsys.readouterr().out


def test_plugins_table_of_an_installed_distribution(plugin_sites):
    done = plugin_sites.run("example", ["fabric", "plugins"])
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0].split()
    assert header == ["KIND", "NAME", "ALIASES", "DISTRIBUTION", "VERSION", "STATUS", "DESCRIPTION"]
    rows = _rows(done.stdout)
    assert rows[("strategy", "example_single")][2:6] == [
        "example_counting",
        "fabric-example-plugin",
        "0.3.1",
        "not checked",
    ]
    assert rows[("precision", "32-true")][2:4] == ["32", "fabric-core"]
    assert {kind for kind, _ in rows} == {
        "accelerator", "strategy", "precision", "launcher", "environment", "logger", "checkpoint_format"
    }
    assert rows[("logger", "csv")][2:4] == ["-", "fabric-core"]
    assert "fabric plugins --check" in done.stdout


def test_plugins_json_and_python_dash_m(plugin_sites):
    script = plugin_sites.run(
        "example", ["fabric", "plugins", "--json", "--kind", "strategy", "--kind", "precision"]
    )
    module = plugin_sites.run(
        "example",
        ["python", "-m", "fabric_core", "plugins", "--json", "--kind", "strategy", "--kind", "precision"],
    )
    assert script.returncode == 0 and module.returncode == 0, script.stderr + module.stderr
    report = json.loads(script.stdout)
    assert json.loads(module.stdout) == report
    assert set(report) == {
        "fabric_core_version", "checked", "entries", "plugins", "failures", "conflicts", "not_loaded", "blocked",
        "unknown_names",
    }  # fmt: skip
    example_plugin = next(p for p in report["plugins"] if p["distribution"] == "fabric-example-plugin")
    assert example_plugin["plugin"] == "example" and example_plugin["decision_hooks"] == []
    assert report["checked"] is False
    assert {e["kind"] for e in report["entries"]} == {"strategy", "precision"}
    example = next(e for e in report["entries"] if e["name"] == "example_single")
    assert set(example) == {
        "kind",
        "name",
        "aliases",
        "distribution",
        "version",
        "target",
        "description",
        "status",
        "error",
        "reason",
    }
    assert (example["distribution"], example["version"], example["status"]) == (
        "fabric-example-plugin",
        "0.3.1",
        "not checked",
    )


def test_plugins_table_lists_failures_and_conflicts(plugin_sites):
    done = plugin_sites.run("zoo", ["fabric", "plugins"])
    assert done.returncode == 0, done.stderr  # listing works despite broken plugins; only --check fails
    out = done.stdout
    assert "strategy 'twin': using fabric-conflict-a, ignoring fabric-conflict-b" in out
    assert "strategy 'replaced': using fabric-conflict-b, ignoring fabric-conflict-a" in out
    assert re.search(
        r"fabric-broken-import 1\.0\.0 .*ModuleNotFoundError: No module named 'fabric_missing_dependency_for_tests'",
        out,
    )
    assert "fabric-hook-raises 2.0.0" in out and "registration exploded on purpose" in out
    assert "FabricPluginWarning" not in done.stderr  # reported once, in the table, not as Python warnings


class _Unavailable(CPUAccelerator):
    @staticmethod
    def is_available() -> bool:
        return False


class _Plugin:
    @hookimpl
    def fabric_register_accelerators(self, registrar):
        registrar.add("never_here", _Unavailable, description="hardware this machine lacks")

    @hookimpl
    def fabric_register_strategies(self, registrar):
        registrar.add(
            "missing_module", "fabric_no_such_module.strategy:Strategy", description="cannot import"
        )


def test_check_reports_availability_and_import_errors(monkeypatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = build_registry(extra_plugins=(_Plugin(),))
    unchecked = collect_plugins(registry)
    assert {e["status"] for e in unchecked["entries"]} == {"not checked"}

    report = collect_plugins(registry, check=True, kinds=["accelerator", "strategy"])
    status = {e["name"]: (e["status"], e["error"]) for e in report["entries"]}
    assert status["cpu"] == ("available", None)
    assert status["never_here"] == ("unavailable", None)
    assert status["single_device"] == ("available", None)
    assert status["missing_module"][0] == "error"
    assert "ModuleNotFoundError: No module named 'fabric_no_such_module'" in status["missing_module"][1]
    rows = _rows(format_table(report))
    assert rows[("strategy", "missing_module")][5].startswith("error: ModuleNotFoundError")
    assert rows[("accelerator", "never_here")][5] == "unavailable"


class _NeedsAPackage(FullPrecision):
    @classmethod
    def unavailable_reason(cls):
        return "needs the `no_such_package` package: `pip install no-such-package`"


class _PrecisionPlugin:
    @hookimpl
    def fabric_register_precisions(self, registrar):
        registrar.add("needs_package", _NeedsAPackage, description="a precision whose library is absent")


def test_check_says_what_an_unavailable_precision_lacks(monkeypatch):
    """A precision class answering `unavailable_reason()` is listed as unavailable with that reason (an install line),
    not as available and not as broken; the others stay available."""
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = build_registry(extra_plugins=(_PrecisionPlugin(),))
    report = collect_plugins(registry, check=True, kinds=["precision"])
    entries = {e["name"]: e for e in report["entries"]}
    missing = entries["needs_package"]
    assert (missing["status"], missing["error"]) == ("unavailable", None)
    assert missing["reason"] == "needs the `no_such_package` package: `pip install no-such-package`"
    assert (entries["32-true"]["status"], entries["32-true"]["reason"]) == ("available", None)
    rows = _rows(format_table(report))
    assert rows[("precision", "needs_package")][5] == f"unavailable: {missing['reason']}"
    assert collect_plugins(registry, kinds=["precision"])["entries"][0]["status"] == "not checked"


def test_table_of_a_registry_with_a_conflict(monkeypatch):
    class Twin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("single_device", "somewhere:Else")

    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.warns(FabricPluginWarning):
        registry = build_registry(extra_plugins=(Twin(),))
    report = collect_plugins(registry)
    assert report["conflicts"] == [
        {"kind": "strategy", "name": "single_device", "ignored": "Twin", "used": "fabric-core", "reason": "first registration wins"}
    ]
    assert "strategy 'single_device': using fabric-core, ignoring Twin" in format_table(report)


# ------------------------------------------------------------------------------------------------ fabric run's line
from fabric_core import cli_run  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train.py", "--devices", "2", "--strategy", "ddp"], {"devices": "2", "strategy": "ddp", "script_args": []}),
        (["train.py", "--accelerator=gpu", "--devices=4"], {"accelerator": "gpu", "devices": "4", "script_args": []}),
        (["train.py", "a", "--devices=4", "b", "--lr", "0.1"], {"devices": "4", "script_args": ["a", "b", "--lr", "0.1"]}),
        (["--devices", "2", "train.py", "--", "--devices", "3"], {"devices": "2", "script_args": ["--devices", "3"]}),
        (["train.py", "a", "--", "b", "-m"], {"script_args": ["a", "b", "-m"]}),
        (["-m", "pkg.train", "-m", "x"], {"module": True, "script": "pkg.train", "script_args": ["-m", "x"]}),
        (["train.py", "--dev", "2"], {"devices": "1", "script_args": ["--dev", "2"]}),  # no abbreviations
        (["train.py", "--num_nodes", "3", "--node-rank=1"], {"num_nodes": 3, "node_rank": 1}),
        (["--devices", "auto", "train.py"], {"devices": "auto"}),
    ],
    ids=["after-script", "seeds-example", "interleaved", "double-dash", "double-dash-middle", "module", "no-abbrev", "ints", "auto"],
)
def test_run_options_are_recognised_anywhere_before_double_dash(argv, expected):
    args = cli_run.parse_run_args(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value, (key, getattr(args, key))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "missing SCRIPT"),
        (["train.py", "--devices"], "option --devices needs a value"),
        (["train.py", "--num-nodes", "two"], "'two' is not a number of nodes N or a range MIN:MAX"),
        (["--lr", "0.1", "train.py"], "unknown option '--lr' before SCRIPT"),
    ],
)
def test_run_usage_errors_exit_2(argv, words, capsys):
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert "Usage: fabric run" in err and words in err


def test_run_help_after_the_script_is_fabrics_help(capsys):
    assert main(["run", "train.py", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: fabric run") and "--devices" in out and "--main-port" in out
