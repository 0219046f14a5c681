"""``fabric env``: the bug-report summary, run as users run it (the console script, in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch

import fabric_core
from fabric_core import cli_env

FABRIC = Path(sys.executable).parent / "fabric"
REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FABRIC_", "PL_", "TORCHELASTIC_", "SLURM_", "PYTEST_"))
        and k not in cli_env.VARIABLE_NAMES
    }
    env.update(extra)
    return env


def _env_command(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    command = [str(FABRIC)] if FABRIC.exists() else [sys.executable, "-m", "fabric_core"]
    return subprocess.run([*command, "env", *args], capture_output=True, text=True, env=_clean_env(**extra), timeout=120)


def _json(**extra: str) -> dict:
    done = _env_command("--json", **extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_json_reports_every_installed_fabric_distribution_with_its_metadata_version():
    report = _json()
    dists = {d["name"]: d for d in report["fabric_distributions"]}
    assert dists["fabric-core"]["version"] == fabric_core.__version__ == report["fabric_core_version"]
    for plugin in sorted((REPO / "plugins").glob("*/pyproject.toml")):
        name = re.search(r'^name\s*=\s*"([^"]+)"', plugin.read_text(), re.M).group(1)
        try:
            installed = version(name)
        except PackageNotFoundError:
            assert name not in dists
            continue
        assert dists[name]["version"] == installed
        assert any(ep.endswith(".register") for ep in dists[name]["entry_points"]), dists[name]
    assert list(dists)[0] == "fabric-core"  # the core first, then the plugins


def _declared_by_installed_plugins(frameworks):
    """The frameworks of those plugins that are installed here (the XLA lane has fabric-xla, not fabric-deepspeed)."""
    return [name for dist, name in frameworks.items() if _installed(dist)]


def _installed(dist):
    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def test_json_reports_torch_python_packages_and_threads():
    report = _json(OMP_NUM_THREADS="1")
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert report["torch"]["cuda_build"] == torch.version.cuda
    assert len(report["torch"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["torch"]["distributed"]["gloo"] is True
    assert report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    for name in _declared_by_installed_plugins({"fabric-deepspeed": "deepspeed", "fabric-xla": "torch-xla"}):
        try:  # always answered, installed or not
            expected = version(name)
        except PackageNotFoundError:
            expected = None
        assert report["packages"][name] == expected
    threads = report["threads"]
    assert threads["cpu_count"] == os.cpu_count()
    assert threads["OMP_NUM_THREADS"] == "1" and threads["torch_intra_op"] == 1
    assert threads["per_process"] == {str(n): 1 for n in cli_env.PROCESS_COUNTS}


def test_variables_that_are_set_are_listed_and_secrets_hidden():
    report = _json(
        FABRIC_TIMEOUT="7", PL_GLOBAL_SEED="3", FABRIC_STORAGE_TOKEN="s3cret", MASTER_PORT="1234", UNRELATED_VAR="x"
    )
    variables = report["environment_variables"]
    assert variables["FABRIC_TIMEOUT"] == "7" and variables["PL_GLOBAL_SEED"] == "3"
    assert variables["MASTER_PORT"] == "1234"
    assert variables["FABRIC_STORAGE_TOKEN"] == cli_env.HIDDEN
    assert "UNRELATED_VAR" not in variables
    text = _env_command(FABRIC_STORAGE_TOKEN="s3cret").stdout
    assert "s3cret" not in text and "FABRIC_STORAGE_TOKEN" in text


def test_the_cluster_environment_that_would_be_detected_is_reported():
    # multiprocess-check: single process (`fabric env` reads the variables; nothing starts)
    assert _json()["fabric"]["cluster_environment"]["name"] == "plain"
    under_torchrun = _json(
        TORCHELASTIC_RUN_ID="job", WORLD_SIZE="4", RANK="3", LOCAL_RANK="1", GROUP_RANK="1", MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29400",
    )  # fmt: skip
    env = under_torchrun["fabric"]["cluster_environment"]
    assert env["name"] == "torchelastic"
    assert (env["world_size"], env["global_rank"], env["local_rank"], env["node_rank"]) == (4, 3, 1, 1)
    assert _json()["fabric"]["auto_accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_text_report_has_every_section_and_imports_no_heavy_framework():
    done = _env_command()
    assert done.returncode == 0, done.stderr
    for title in ("Python", "Fabric distributions", "Packages", "PyTorch", "What Fabric() picks here", "Threads"):
        assert f"\n{title}\n" in done.stdout
    assert "fabric-core:" in done.stdout and torch.__version__ in done.stdout
    probe = (
        "import sys; from fabric_core import cli_env; cli_env.format_report(cli_env.collect());"
        " print(sorted(m for m in ('deepspeed', 'torch_xla', 'wandb', 'mlflow') if m in sys.modules))"
    )
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"


def test_fabric_help_lists_env():
    done = subprocess.run([sys.executable, "-m", "fabric_core", "--help"], capture_output=True, text=True, timeout=60)
    assert re.search(r"^\s+env\s+print versions", done.stdout, re.M), done.stdout


def test_a_third_party_plugin_distribution_is_listed(plugin_sites):
    done = plugin_sites.run("example", ["fabric", "env", "--json"])
    assert done.returncode == 0, done.stderr
    dists = {d["name"]: d for d in json.loads(done.stdout)["fabric_distributions"]}
    source = (REPO / "examples" / "third_party_plugin" / "pyproject.toml").read_text()
    expected = re.search(r'^version\s*=\s*"([^"]+)"', source, re.M).group(1)
    assert dists["fabric-example-plugin"]["version"] == expected
    assert dists["fabric-example-plugin"]["entry_points"] == ["example = fabric_example_plugin.register"]


def test_a_failing_section_is_reported_and_the_rest_survives(monkeypatch: pytest.MonkeyPatch):
    def broken() -> dict:
        raise RuntimeError("no torch here")

    monkeypatch.setattr(cli_env, "torch_info", broken)
    report = cli_env.collect()
    assert report["torch"] == {"error": "RuntimeError: no torch here"}
    text = cli_env.format_report(report)
    assert "PyTorch\n  error:" in text and "no torch here" in text
    assert "fabric-core:" in text and "Threads" in text


def test_every_dependency_of_an_installed_first_party_plugin_is_reported_with_its_version():
    """Answered by each plugin's `fabric_report_packages` hook: what its installed distribution requires (besides
    fabric-core), with the installed version, so a bug report names bitsandbytes, torchao, torchft, ray, ..."""
    from importlib.metadata import requires

    report = _json()
    checked = 0
    for plugin in sorted((REPO / "plugins").glob("*/pyproject.toml")):
        name = re.search(r'^name\s*=\s*"([^"]+)"', plugin.read_text(), re.M).group(1)
        if not _installed(name):
            continue
        for requirement in requires(name) or []:
            if ";" in requirement and "extra ==" in requirement:
                continue  # an optional extra, not a dependency
            dependency = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            if dependency.lower() == "fabric-core":
                continue
            assert dependency in report["packages"], (name, dependency, sorted(report["packages"]))
            assert report["packages"][dependency] == version(dependency), (name, dependency)
            checked += 1
    assert checked >= 1 or not any(_installed(d) for d in ("fabric-bnb", "fabric-ao", "fabric-ft"))
    for dependency in ("bitsandbytes", "torchao", "torchft"):
        owner = {"bitsandbytes": "fabric-bnb", "torchao": "fabric-ao", "torchft": "fabric-ft"}[dependency]
        if _installed(owner):
            assert report["packages"][dependency] == version(dependency)
