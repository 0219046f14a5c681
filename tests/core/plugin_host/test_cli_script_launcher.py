"""``fabric run --launcher NAME``: the core hands the job to a script launcher a plugin registered (here a test plugin
whose launcher runs the script in this machine's processes), passes its ``--NAME-KEY`` options, and refuses unknown
launchers, function-only launchers and torchrun's per-node options with errors that list what works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_core import cli_run
from fabric_core.launchers.base import Launcher, ScriptRequest
from fabric_core.plugins import hookimpl
from fabric_core.strategies.parallel import ParallelStrategy


class LocalScriptLauncher(Launcher):
    """Runs the script once per process, one after another, with the variables the CLI chose plus a rank."""

    runs_scripts = True
    requests: list[ScriptRequest] = []

    def launch(self, function, *args, **kwargs):
        raise NotImplementedError

    @classmethod
    def run_script(cls, request: ScriptRequest) -> int:
        cls.requests.append(request)
        for rank in range(request.processes_per_node * request.num_nodes):
            env = {**request.environment, "RANK": str(rank), "PATH": "/usr/bin:/bin"}
            code = subprocess.run([sys.executable, request.script, *request.script_args], env=env, timeout=60).returncode
            if code:
                return code
        return 0


class Plugin:
    @hookimpl
    def fabric_register_launchers(self, registrar):
        registrar.add("local_test", LocalScriptLauncher)

    @hookimpl
    def fabric_register_strategies(self, registrar):
        registrar.add("parallel_test", ParallelStrategy)  # the core's process-per-device strategy, by a name


@pytest.fixture(autouse=True)
def _restore_environment():
    """``fabric run`` exports its settings into its own process (for torchrun's workers): undo that after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(
        "import os, sys\n"
        "open(sys.argv[1] + os.environ['RANK'], 'w').write(os.environ['FABRIC_DEVICES'] + ' ' + os.environ['FABRIC_CLI_USED'])\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    return path


def test_a_registered_script_launcher_runs_the_job_with_its_options(use_registry, script: Path, tmp_path: Path):
    use_registry(Plugin())
    LocalScriptLauncher.requests.clear()
    out = str(tmp_path / "rank")
    argv = ["--local-test-where", "here", "--launcher", "local_test", "--strategy", "parallel_test", "--devices", "2", "--num-nodes", "2", str(script), out, "0"]
    assert cli_run.main(argv) == 0
    (request,) = LocalScriptLauncher.requests
    assert request.options == {"where": "here"} and (request.processes_per_node, request.num_nodes) == (2, 2)
    assert request.script_args == [out, "0"] and request.max_restarts == 0 and not request.module
    assert [Path(out + str(r)).read_text() for r in range(4)] == ["2 1"] * 4  # FABRIC_* settings reached every process
    assert cli_run.main(["--launcher", "local_test", "--max-restarts", "2", str(script), out, "7"]) == 7  # its exit status
    assert LocalScriptLauncher.requests[-1].max_restarts == 2


def test_launcher_errors_list_what_works(use_registry, script: Path, capsys):
    use_registry(Plugin())

    def error(*argv: str) -> str:
        assert cli_run.main([*argv, str(script), "x", "0"]) == 2
        return capsys.readouterr().err

    assert "--launcher 'nope' is not registered. `fabric run --launcher` takes: torchrun, local_test." in error("--launcher", "nope")
    assert "is not registered. `fabric run --launcher` takes: torchrun, local_test. Did you mean 'local_test'?" in error(
        "--launcher", "local_tset"
    )
    assert "Did you mean" not in error("--launcher", "nope")
    assert "--launcher 'spawn' runs a function in processes of its own, not a script" in error("--launcher", "spawn")
    message = error("--launcher", "local_test", "--strategy", "parallel_test", "--node-rank", "1", "--num-nodes", "2", "--rdzv-backend", "c10d")
    assert "--node-rank, --rdzv-backend: torchrun's options" in message and "--local-test-KEY VALUE" in message
    assert "unknown option '--other-thing' before SCRIPT" in error("--launcher", "local_test", "--other-thing", "1")
    assert "unknown option '--local-test-where' before SCRIPT" in error("--local-test-where", "1")  # no --launcher
    assert "torchrun takes no --torchrun-... options" in error("--launcher", "torchrun", "--torchrun-x", "1")
