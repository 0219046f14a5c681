"""What fabric-wandb and fabric-mlflow promise as plugins, checked for both alike in fresh interpreters: their names
are registered through the entry point; discovering plugins and a `Fabric` without a tracker import neither tracker;
`Fabric(loggers=NAME)` builds the logger with nothing else imported by the user; a tracker whose package is broken
fails that name only, reported like a broken plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from jobs import job_env

TRACKERS = {"wandb": ("fabric-wandb", "WandbLogger"), "mlflow": ("fabric-mlflow", "MLFlowLogger")}


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=job_env(**env))


def test_no_tracker_is_imported_by_discovery_or_a_fabric_without_loggers():
    code = """
import sys
from fabric_core import Fabric
from fabric_core.plugins import get_registry
registry = get_registry()
names = {e.name: e.distribution for e in registry.entries("logger")}
assert names == {"csv": "fabric-core", "tensorboard": "fabric-core", "wandb": "fabric-wandb", "mlflow": "fabric-mlflow", "ray": "fabric-ray"}, names
assert all(f"fabric_{t}.register" in sys.modules for t in ("wandb", "mlflow", "ray"))
Fabric(accelerator="cpu")
Fabric(accelerator="cpu", loggers="csv")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "mlflow", "ray") or m in ("fabric_wandb.logger", "fabric_mlflow.logger", "fabric_ray.logger"))
assert not loaded, loaded
print("ok")
"""
    done = _python(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_a_tracker_by_name_with_options(name, tmp_path):
    dist, cls = TRACKERS[name]
    options = {"wandb": {"project": "p", "save_dir": str(tmp_path), "offline": True}, "mlflow": {"experiment_name": "e"}}[name]
    code = f"""
from fabric_core import Fabric
default, = Fabric(accelerator="cpu", loggers={name!r}).loggers
chosen, = Fabric(accelerator="cpu", loggers={{{name!r}: {options!r}}}).loggers
assert type(default).__name__ == type(chosen).__name__ == {cls!r}
print(default.name, chosen.name, default.version)
"""
    done = _python(code, WANDB_MODE="offline")
    assert done.returncode == 0, done.stderr[-3000:]
    default_name, chosen_name, version = done.stdout.split()
    assert (default_name, chosen_name, version) == {"wandb": ("fabric_logs", "p", "None"), "mlflow": ("fabric_logs", "e", "None")}[name]


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_a_broken_tracker_package_fails_its_name_only(name, tmp_path):
    """The tracker's own package raises at import (a broken install): everything else keeps working; the name
    fails with the plugin's distribution and version, at construction; `fabric plugins --check` reports it."""
    dist, _ = TRACKERS[name]
    shadow = tmp_path / "shadow" / name
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this installation of the tracker is broken')\n")
    code = f"""
from fabric_core import Fabric
from fabric_core.plugins import PluginImportError
Fabric(accelerator="cpu", loggers="csv")
try:
    Fabric(accelerator="cpu", loggers={name!r})
except PluginImportError as err:
    print(err)
else:
    raise SystemExit("no error")
"""
    env = {"PYTHONPATH": str(tmp_path / "shadow")}
    done = _python(code, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"The logger {name!r} is provided by {dist} 0.1.0, but importing" in done.stdout
    assert "this installation of the tracker is broken" in done.stdout

    report = _python("import sys; from fabric_core.cli import main; sys.exit(main(['plugins', '--check', '--json', '--kind', 'logger']))", **env)
    entries = {e["name"]: e for e in json.loads(report.stdout)["entries"]}
    assert entries[name]["status"] == "error" and "broken" in entries[name]["error"]
    assert entries["csv"]["status"] == "available"
    assert report.returncode == 1  # --check fails when something is broken


def test_registration_modules_stay_light():
    """`fabric plugins --check` flags a registration module that imported a tracker (it runs for every Fabric)."""
    done = _python("import sys; from fabric_core.cli import main; sys.exit(main(['plugins', '--check', '--json']))")
    report = json.loads(done.stdout)
    ours = {p["distribution"]: p for p in report["plugins"] if p["distribution"] in ("fabric-wandb", "fabric-mlflow")}
    assert set(ours) == {"fabric-wandb", "fabric-mlflow"}
    assert all("heavy_imports" in p and not p["heavy_imports"] for p in ours.values()), ours
