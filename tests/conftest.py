"""Shared fixtures. ``plugin_sites`` installs real distributions for the plugin-mechanics tests.

Entry points only exist for installed distributions, so those tests install real ones: the sources are copied
to a temporary folder, ``pip install``-ed (no network, no build isolation) into a private *site* directory,
and the checks run in a subprocess with ``PYTHONPATH=<site>``. The project's venv is never modified, and a
site is built once per test session and shared between xdist workers (a file lock guards the build).

fabric-core itself is installed into every site too, so the ``fabric`` console script that runs is the one pip
generates from fabric-core's metadata (``<site>/bin/fabric``), exactly what a user gets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import dependencies
import pytest
from jobs import end_leftover_jobs

REPO = Path(__file__).resolve().parents[1]
PLUGIN_FIXTURES = REPO / "tests" / "core" / "plugin_fixtures"
EXAMPLE_PLUGIN = REPO / "examples" / "third_party_plugin"

#: The sites the tests use: name -> source folders of the distributions installed into it (besides the core).
SITES: dict[str, tuple[Path, ...]] = {
    "example": (EXAMPLE_PLUGIN,),
    "zoo": (
        EXAMPLE_PLUGIN,
        PLUGIN_FIXTURES / "broken_import",
        PLUGIN_FIXTURES / "hook_raises",
        PLUGIN_FIXTURES / "bad_target",
        PLUGIN_FIXTURES
        / "conflict_b",  # installed before conflict_a: the winner must not depend on install order
        PLUGIN_FIXTURES / "conflict_a",
    ),
    # Plugins that the strict, isolating loader must reject or contain, each naming its distribution.
    "strict": (
        EXAMPLE_PLUGIN,
        PLUGIN_FIXTURES / "hook_typo",
        PLUGIN_FIXTURES / "exits_at_import",
        PLUGIN_FIXTURES / "raising_decisions",
        PLUGIN_FIXTURES / "heavy_register",
        PLUGIN_FIXTURES / "squatter",
    ),
    # A checkpoint format registered by a distribution that provides no strategy.
    "formats": (PLUGIN_FIXTURES / "keyed_format",),
    # Two third-party plugins written from docs/plugins.md alone: a checkpoint format and a script launcher.
    "thirdparty": (PLUGIN_FIXTURES / "npz_format", PLUGIN_FIXTURES / "local_launcher"),
}


class PluginSites:
    """Builds sites on demand and runs Python or the ``fabric`` script against one."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def site(self, name: str) -> Path:
        target = self.root / f"site-{name}"
        with open(self.root / f"site-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / ".complete").exists():
                shutil.rmtree(target, ignore_errors=True)
                self._install(name, target, (REPO / "core", *SITES[name]))
                (target / ".complete").touch()
        return target

    def _install(self, name: str, target: Path, sources: Sequence[Path]) -> None:
        # Build from copies: an in-tree setuptools build would write build/ and *.egg-info into the repo.
        shutil.rmtree(self.root / f"src-{name}", ignore_errors=True)  # leftovers of an interrupted build
        copies = []
        for source in sources:
            copy = self.root / f"src-{name}" / source.name
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            copies.append(str(copy))
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
        command += ["--no-build-isolation", "--disable-pip-version-check", "--target", str(target), *copies]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"pip install into {target} failed:\n{done.stdout}\n{done.stderr}")

    def run(
        self, site: str, args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` with the site on ``PYTHONPATH``; ``"python"``/``"fabric"`` as ``args[0]`` are resolved."""
        path = self.site(site)
        program = {"python": sys.executable, "fabric": str(path / "bin" / "fabric")}.get(args[0], args[0])
        clean = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_") and k != "PYTHONPATH"}
        clean.update(PYTHONPATH=str(path), PYTHONWARNINGS="default", **(env or {}))
        return subprocess.run(
            [program, *args[1:]], capture_output=True, text=True, env=clean, timeout=timeout
        )

    def python(
        self, site: str, code: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.run(site, ["python", "-c", code], env=env)


def pytest_configure(config: pytest.Config) -> None:
    """In the venv `make setup` made, a missing dependency stops the run before the first test and an import that
    fails is an error, not a skip (``tests/dependencies.py``); elsewhere (the XLA lane's partial venv, the GPU
    lane's interpreter) tests skip what is not installed."""
    if not dependencies.is_make_setup_venv():
        return
    absent = dependencies.missing()
    if absent:
        raise pytest.UsageError(dependencies.report(absent))
    pytest.importorskip = dependencies.strict_importorskip


@pytest.fixture(autouse=True)
def _end_leftover_jobs():
    """A job a failed test left running is ended with it (see ``jobs.end_leftover_jobs``)."""
    yield
    end_leftover_jobs()


@pytest.fixture(autouse=True)
def _no_srun_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs alike on a SLURM login node, where every ``Fabric()`` would warn that ``srun`` is unused
    (``tests/core/test_environments.py`` tests that warning with ``srun`` put back)."""
    from fabric_core.environments import slurm

    monkeypatch.setattr(slurm, "_srun_available", lambda: False)


@pytest.fixture(scope="session")
def plugin_sites(tmp_path_factory: pytest.TempPathFactory) -> PluginSites:
    # Under xdist every worker has its own base temp; their common parent is shared by the whole session.
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = root / "plugin-sites"
    root.mkdir(exist_ok=True)
    return PluginSites(root)


@pytest.fixture
def install_hint():
    """The regex an install hint must match for ``dist``: installed-but-skipped (autoload off) or absent."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution

    def expected(dist: str) -> str:
        try:
            distribution(dist)
        except PackageNotFoundError:
            return re.escape(f"pip install {dist}")
        return re.escape(f"FABRIC_PLUGINS={dist}")

    return expected
