"""Old import paths of modules that moved keep working for a deprecation period (``fabric_core.utilities.deprecation``):
a third-party plugin written against them, pip-installed and found through its entry point, still registers, decides
and trains; each old path warns once, naming the new one. Fresh interpreters, because a module warns when first
imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

from plugin_doubles import last_json_line

#: old path -> new path, and names the old module had that must still resolve there (to the new module's objects).
MOVED = {
    "fabric_core.hookspecs": ("fabric_core.plugins.hookspecs", ["hookimpl", "hookspec", "fabric_register_strategies", "HOOK_NAMES"]),
    "fabric_core.registry": ("fabric_core.plugins.registry", ["Registrar", "Registry", "PluginImportError", "FabricPluginWarning"]),
    "fabric_core.decisions": ("fabric_core.plugins.decisions", ["Decisions", "trace"]),
    "fabric_core.discovery": ("fabric_core.plugins.discovery", ["build_registry", "validate", "HEAVY_MODULES"]),
    "fabric_core.builtin": ("fabric_core.plugins.builtin", ["FIRST_PARTY", "fabric_register_strategies"]),
    "fabric_core.launchers.failures": ("fabric_core.runtime.failures", ["record_uncaught_errors", "RankFailure", "report"]),
    "fabric_core.utilities.hang": ("fabric_core.runtime.hang", ["report_progress", "start_watchdog", "HangError"]),
    "fabric_core.utilities.failures": ("fabric_core.runtime.failures", ["record_uncaught_errors", "RankFailure", "report"]),
    "fabric_core.utilities.process_group": ("fabric_core.runtime.process_group", ["release_at_exit", "release_process_group"]),
    "fabric_core.utilities.progress": ("fabric_core.runtime.progress", ["ProgressBar"]),
    "fabric_core.utilities.throughput": ("fabric_core.runtime.throughput", ["Throughput", "ThroughputMonitor", "measure_flops", "get_available_flops"]),
    "fabric_core.utilities.resume": ("fabric_core.runtime.resume", ["RandomStates", "find_latest_checkpoint"]),
    "fabric_core.io.formats": ("fabric_core.io.format", ["CheckpointReader", "FindReader"]),
    "fabric_fsdp.formats": ("fabric_fsdp.layout", ["is_sharded_checkpoint", "sharded_location", "META_FILE"]),
    "fabric_deepspeed.formats": ("fabric_deepspeed.layout", ["is_deepspeed_checkpoint", "read_tag", "LATEST"]),
}  # fmt: skip

#: Names that moved to another module than the rest of theirs: (old module, name) -> (module, name).
ELSEWHERE = {
    ("fabric_core.registry", "get_registry"): ("fabric_core.plugins.host", "get_registry"),
    ("fabric_core.registry", "reset_registry"): ("fabric_core.plugins.host", "reset_registry"),
    ("fabric_core.registry", "build_registry"): ("fabric_core.plugins.host", "build_registry"),
    ("fabric_core.registry", "KINDS"): ("fabric_core.plugins.kinds", "KINDS"),
    ("fabric_core.discovery", "REGISTRATION_HOOKS"): ("fabric_core.plugins.kinds", "KINDS"),
}


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-W", "default", "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return last_json_line(done.stdout)


def _installed(moved: dict) -> dict:
    """The entries whose package is installed here (the XLA lane installs fabric-core and fabric-xla only)."""
    return {old: entry for old, entry in moved.items() if importlib.util.find_spec(old.split(".")[0]) is not None}


def test_each_old_path_warns_once_with_the_new_path_and_hands_out_the_same_objects():
    moved = _installed(MOVED)
    assert "fabric_core.hookspecs" in moved  # the core's own shims are always checked
    code = f"""
        import importlib, json, warnings
        from fabric_core.utilities.deprecation import FabricDeprecationWarning
        MOVED, ELSEWHERE = {moved!r}, {ELSEWHERE!r}
        result = {{}}
        for old, (new, names) in MOVED.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
                importlib.import_module(old)  # already imported: no second warning
            target = importlib.import_module(new)
            same = all(getattr(module, n) is getattr(target, n) for n in names)
            same_in_all = all(getattr(module, n) is getattr(target, n) for n in module.__all__ if hasattr(target, n))
            try:
                module.no_such_name
                missing = None
            except AttributeError as err:
                missing = str(err)
            result[old] = {{
                "warnings": [(w.category.__name__, issubclass(w.category, DeprecationWarning), str(w.message)) for w in caught],
                "same": same, "same_in_all": same_in_all, "names_listed": sorted(set(names) - set(module.__all__)),
                "missing": missing,
            }}
        result["elsewhere"] = all(
            getattr(importlib.import_module(old), name) is getattr(importlib.import_module(module), attr)
            for (old, name), (module, attr) in ELSEWHERE.items()
        )
        print(json.dumps(result))
    """
    result = _python(code)
    for old, (new, _) in moved.items():
        seen = result[old]
        assert len(seen["warnings"]) == 1, (old, seen["warnings"])
        ((category, is_deprecation, message),) = seen["warnings"]
        assert category == "FabricDeprecationWarning" and is_deprecation
        assert f"`{old}` moved to `{new}`" in message and "removes it" in message, message
        assert seen["same"] and seen["same_in_all"] and seen["names_listed"] == [], (old, seen)
        assert f"module {old!r} (moved to {new!r}) has no attribute 'no_such_name'" == seen["missing"]
    assert result["elsewhere"]


def test_the_warning_points_at_the_importing_line():
    """Attributed to the code with the old import (not to the shim), so the warning says which line to change."""
    code = """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from fabric_core.hookspecs import hookimpl  # the old path
        print(json.dumps([(w.filename, w.lineno) for w in caught]))
    """
    assert _python(code) == [["<string>", 5]]


def test_a_plugin_written_against_the_old_paths_registers_decides_and_trains(plugin_sites):
    """fabric-old-paths (tests/core/plugin_fixtures/old_paths) imports ``hookimpl`` from ``fabric_core.hookspecs``, its
    types from ``fabric_core.registry`` and a helper from ``fabric_core.launchers.failures``; installed with pip and
    found through its entry point, it registers a strategy, its decision hook is asked, and a step trains."""
    code = """
        import json, warnings
        import torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from fabric_core import Fabric
            from fabric_core.plugins import get_registry

            entry = get_registry().get("strategy", "old_paths_single")
            fabric = Fabric(accelerator="cpu", strategy="old_paths_single", devices=1)
        import fabric_old_paths.register as plugin

        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        before = model.weight.detach().clone()
        fabric.backward(model(torch.ones(4, 2)).sum())
        optimizer.step()
        print(json.dumps({
            "distribution": entry.distribution,
            "strategy": type(fabric.strategy).__name__,
            "exit_description": fabric.strategy.describe_exit(137),
            "asked": plugin.ASKED,
            "trained": not torch.equal(before, model.weight.detach()),
            "deprecations": sorted({str(w.message).split(":")[0] for w in caught if issubclass(w.category, DeprecationWarning)}),
        }))
    """
    done = plugin_sites.python("old_paths", textwrap.dedent(code))
    assert done.returncode == 0, done.stderr
    result = last_json_line(done.stdout)
    assert (result["distribution"], result["strategy"]) == ("fabric-old-paths", "OldPathsStrategy")
    assert result["asked"] == ["32-true"] and result["trained"]
    assert "SIGKILL" in result["exit_description"], result["exit_description"]
    assert result["deprecations"] == [
        "`fabric_core.hookspecs` moved to `fabric_core.plugins.hookspecs`",
        "`fabric_core.launchers.failures` moved to `fabric_core.runtime.failures`",
        "`fabric_core.registry` moved to `fabric_core.plugins.registry`",
    ], result["deprecations"]
