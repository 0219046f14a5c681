"""Behaviours docs/decisions.md promises to keep as the reference's, checked as a user of the reference meets them:
a ``CheckpointIO`` whose ``load_checkpoint`` is replaced on the object reads folders, the reference's wordings
(TensorBoard's graph warnings, the interactive-session error, the duplicate-plugins listing) and the CLI's
``Usage:`` line and exit statuses. (Kubeflow's setter words: tests/core/test_torchrun_variables.py; the FSDP
messages: tests/plugins/fsdp.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
from jobs import job_env
from torch import nn

from fabric_core import Fabric
from fabric_core.environments import PlainEnvironment
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_core.precision import DoublePrecision, Precision


# ---------------------------------------------------------------------------------------------- CheckpointIO
def _a_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "written-by-my-io"
    folder.mkdir()
    (folder / "part-0").write_bytes(b"whatever my io writes")
    return folder


def test_a_load_checkpoint_mocked_on_the_object_is_asked_for_a_folder(tmp_path: Path):
    io = TorchCheckpointIO()
    io.load_checkpoint = Mock(return_value={"step": 5, "extra": 1})
    fabric = Fabric(accelerator="cpu", plugins=[io])
    folder = _a_folder(tmp_path)
    state = {"step": 0}
    assert fabric.load(folder, state) == {"extra": 1}
    assert state["step"] == 5
    assert io.load_checkpoint.call_count == 1
    assert Path(str(io.load_checkpoint.call_args.args[0])) == folder


def test_a_load_checkpoint_overridden_on_one_object_reads_its_own_folders(tmp_path: Path):
    """A per-object override (not a subclass): this instance reads folders of one file per key."""

    def load_folder(path, map_location=None, weights_only=None, **kwargs):
        return {p.name: torch.load(p, weights_only=True) for p in Path(str(path)).iterdir()}

    io = TorchCheckpointIO()
    io.load_checkpoint = load_folder
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.manual_seed(0)
    saved = nn.Linear(3, 2)
    torch.save(saved.state_dict(), folder / "model")
    torch.save(7, folder / "step")
    fabric = Fabric(accelerator="cpu", plugins=[io])
    model = fabric.setup(nn.Linear(3, 2))
    state = {"model": model, "step": 0}
    fabric.load(folder, state)
    assert state["step"] == 7
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    # Another TorchCheckpointIO object keeps refusing a folder it did not write.
    plain = Fabric(accelerator="cpu", plugins=[TorchCheckpointIO()])
    with pytest.raises(ValueError, match="It is a directory, but no installed plugin recognises it"):
        plain.load(folder, {"step": 0})


# ---------------------------------------------------------------------------------------------- wordings
def test_tensorboard_graph_warnings_in_the_references_words(tmp_path: Path):
    pytest.importorskip("tensorboard", reason="TensorBoardLogger needs tensorboard (requirements-dev.txt has it)")
    from fabric_core.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(UserWarning) as missing:
        logger.log_graph(nn.Linear(4, 2))
    assert str(missing[0].message) == (
        "Could not log computational graph to TensorBoard: The `model.example_input_array` attribute is not set or"
        " `input_array` was not given."
    )
    with pytest.warns(UserWarning) as untraceable:
        logger.log_graph(nn.Linear(4, 2), input_array={"x": 1})
    assert str(untraceable[0].message).startswith(
        "Could not log computational graph to TensorBoard: The `input_array` or `model.example_input_array` has type"
        " <class 'dict'> which can't be traced by TensorBoard. Make the input array a tuple representing the"
        " positional arguments to the model's `forward()` implementation"
    )


def test_the_interactive_session_error_names_the_strategy_used(monkeypatch):
    """`strategy="dp"` on CPUs becomes ddp (with the reference's warning); the error names 'ddp', as the reference's."""
    pytest.importorskip("fabric_ddp", reason="'dp' and 'ddp' are fabric-ddp's (the XLA lane installs only fabric-xla)")
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    with pytest.warns(UserWarning, match="'dp' is not supported on CPUs, hence setting `strategy='ddp'`"):
        with pytest.raises(RuntimeError) as err:
            Fabric(accelerator="cpu", strategy="dp", devices=2)
    assert str(err.value).startswith(
        "`Fabric(strategy='ddp')` is not compatible with an interactive environment. Run your code as a script, or"
        " choose one of the compatible strategies:"
    )


@pytest.mark.parametrize(
    ("plugins", "listed"),
    [
        ([PlainEnvironment(), DoublePrecision(), PlainEnvironment(), Precision()], "ClusterEnvironment, Precision"),
        ([DoublePrecision(), PlainEnvironment(), Precision(), PlainEnvironment()], "Precision, ClusterEnvironment"),
        ([TorchCheckpointIO(), Precision(), TorchCheckpointIO()], "CheckpointIO"),
    ],
)
def test_duplicate_plugins_are_listed_in_the_order_they_first_appear(plugins, listed):
    with pytest.raises(ValueError) as err:
        Fabric(accelerator="cpu", plugins=plugins)
    assert str(err.value) == (
        f"Received multiple values for {listed} flags in `plugins`. Expected one value for each type at most."
    )


# ---------------------------------------------------------------------------------------------- the CLI
def _fabric(*args: str) -> subprocess.CompletedProcess:
    """``fabric ARGS`` as users type it: the console script beside this interpreter (``python -m fabric_core``
    where it is not installed)."""
    script = Path(sys.executable).parent / "fabric"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fabric_core"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, env=job_env())


def test_fabric_run_help_starts_with_the_references_usage_line():
    done = _fabric("run", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: fabric run [OPTIONS] SCRIPT [SCRIPT_ARGS]...\n"), done.stdout[:200]
    error = _fabric("run", "--devices")  # a usage error shows the same line
    assert error.returncode == 2 and error.stderr.startswith("Usage: fabric run [OPTIONS] SCRIPT"), error.stderr


def test_fabric_consolidate_of_a_missing_path_is_a_usage_error(tmp_path: Path):
    done = _fabric("consolidate", str(tmp_path / "no-such-checkpoint"))
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert re.search(r"^usage: fabric consolidate .*CHECKPOINT_DIR", done.stderr, re.MULTILINE), done.stderr
    assert "fabric consolidate: error: The provided checkpoint folder does not exist:" in done.stderr
    assert not (tmp_path / "no-such-checkpoint.consolidated").exists()
