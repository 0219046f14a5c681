"""The examples run end to end: each is started as a user would start it, in a fresh process, with tiny settings.

What is checked is what a user sees: the final summary line (parsed), a finite loss, the checkpoint (it exists and
loads into the model), the CSV metrics and the TensorBoard event file. Two-process runs (``fabric.launch`` and
``fabric run``) need fabric-ddp and skip without it.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import psutil
import pytest
import torch
from jobs import free_port

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo" / "train_lm.py"
DIGITS_PLAIN = REPO / "examples" / "digits" / "plain_pytorch.py"
DIGITS_FABRIC = REPO / "examples" / "digits" / "with_fabric.py"

# Tiny model and run for the demo: the point is that every code path runs, not that the model learns.
DEMO_TINY = [
    "--max-steps", "4", "--batch-size", "4", "--accumulate", "2", "--seq-len", "32", "--d-model", "32",
    "--layers", "1", "--heads", "2", "--warmup", "2", "--log-every", "1", "--sample-bytes", "8",
]  # fmt: skip
DEMO_FINAL = re.compile(
    r"^final loss (?P<loss>\S+) \| tokens/s (?P<tps>\d+) \| world_size (?P<world>\d+) \| checkpoint (?P<ckpt>.+)$",
    re.M,
)
DIGITS_FINAL = re.compile(
    r"^final test loss (?P<loss>\S+) \| accuracy (?P<acc>\S+)% \| world_size (?P<world>\d+) \| checkpoint (?P<ckpt>.+)$",
    re.M,
)
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
TIMEOUT = 240  # seconds per example run; a hang fails the test instead of blocking the suite

has_ddp = importlib.util.find_spec("fabric_ddp") is not None
needs_ddp = pytest.mark.skipif(not has_ddp, reason="fabric-ddp is not installed (pip install -e plugins/ddp)")


def fabric_run() -> list[str]:
    """``fabric run`` for 2 CPU processes as the console script would start it (``python -m fabric_core`` is the
    same entry point), on a free port so that concurrent tests do not meet at the default rendezvous port."""
    port = free_port()
    return [sys.executable, "-m", "fabric_core", "run", "--devices", "2", "--accelerator", "cpu", "--main-port", str(port)]  # fmt: skip


def _example_env() -> dict[str, str]:
    """The test process's environment minus anything that would make the example think a launcher started it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    for key in LAUNCHER_VARS:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["STANDALONE_PORT"] = str(free_port())  # the launcher's rendezvous port, claimed for this test alone
    return env


def _kill_tree(pid: int) -> None:
    """Kill ``pid``'s process group and all its descendants (torchrun may put workers in sessions of their own)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def run_example(cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> str:
    """Run ``cmd`` in its own session; on timeout kill it and every process it started (the other ranks)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_example_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s. Output:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}. Output:\n{output[-6000:]}"
    return output


def _load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ demo
def check_demo_run(output: str, out_dir: Path, world_size: int) -> None:
    matches = list(DEMO_FINAL.finditer(output))
    assert len(matches) == 1, f"expected one final line (from rank 0 only), got {len(matches)}:\n{output}"
    final = matches[0]
    # The progress bar (rank 0 only; plain lines, as the output is not a terminal): a first and a closing line.
    progress = [line for line in output.splitlines() if line.startswith("train step ")]
    assert len(progress) == 2 and progress[0].startswith("train step 1/4 (25%) | loss "), progress
    assert progress[1].startswith("train step 4/4 (100%) | loss ") and "tokens/s (average)" in progress[1], progress
    loss = float(final["loss"])
    assert math.isfinite(loss) and 0 < loss < 8, loss  # uniform guessing over 256 bytes is ln(256) = 5.55
    assert int(final["tps"]) > 0
    assert int(final["world"]) == world_size
    assert "checkpoint round trip OK" in output

    ckpt = Path(final["ckpt"])
    assert ckpt == (out_dir / "checkpoints" / "lm-final.ckpt").resolve()
    checkpoint = torch.load(ckpt, weights_only=True)  # plain tensors and containers only
    assert checkpoint["step"] == 4
    assert set(checkpoint) >= {"model", "optimizer", "step", "hparams"}
    demo = _load_module(DEMO)
    hp = checkpoint["hparams"]
    model = demo.ByteTransformerLM(hp["d_model"], hp["layers"], hp["heads"], hp["seq_len"])
    model.load_state_dict(checkpoint["model"])  # strict: no DDP "module." prefixes, nothing missing
    assert len(checkpoint["optimizer"]["state"]) == len(list(model.parameters()))

    metrics_files = list((out_dir / "csv").glob("version_*/metrics.csv"))
    assert len(metrics_files) == 1, metrics_files
    with open(metrics_files[0], newline="") as handle:
        rows = list(csv.DictReader(handle))
    train_rows = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in train_rows] == [1, 2, 3, 4]
    assert all(math.isfinite(float(r["train/loss"])) for r in train_rows)
    # The logged loss of the last step is the all-reduced loss the final line reports.
    assert float(train_rows[-1]["train/loss"]) == pytest.approx(loss, abs=1e-4)
    assert any(r.get("val/loss") for r in rows)

    events = list((out_dir / "tensorboard").glob("version_*/events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0, events


def test_demo_single_process(tmp_path: Path) -> None:
    # multiprocess-check: single process (devices=1)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, str(DEMO), *DEMO_TINY, "--devices", "1", "--strategy", "auto"]
    output = run_example([*cmd, "--out-dir", str(out_dir)], cwd=tmp_path)
    check_demo_run(output, out_dir, world_size=1)


@needs_ddp
@pytest.mark.multiprocess
def test_demo_two_processes_launch_and_fabric_run_agree(tmp_path: Path) -> None:
    """The `make demo` configuration (ddp on 2 CPU processes, started by `fabric.launch`) with a tiny model, and
    the same script started by `fabric run`: both work, and they compute exactly the same thing."""
    launched = run_example([sys.executable, str(DEMO), *DEMO_TINY, "--out-dir", "launch"], cwd=tmp_path)
    assert "strategy=DDPStrategy" in launched
    check_demo_run(launched, tmp_path / "launch", world_size=2)

    cli = run_example([*fabric_run(), str(DEMO), *DEMO_TINY, "--out-dir", "cli"], cwd=tmp_path)
    assert "strategy=DDPStrategy" in cli
    check_demo_run(cli, tmp_path / "cli", world_size=2)

    assert DEMO_FINAL.search(cli)["loss"] == DEMO_FINAL.search(launched)["loss"]
    ckpt = Path("checkpoints", "lm-final.ckpt")
    _assert_same_weights(tmp_path / "launch" / ckpt, tmp_path / "cli" / ckpt)


def _assert_same_weights(first: Path, second: Path) -> None:
    a = torch.load(first, weights_only=True)["model"]
    b = torch.load(second, weights_only=True)["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ digits
def check_digits_run(output: str, world_size: int) -> tuple[float, float, Path]:
    matches = list(DIGITS_FINAL.finditer(output))
    assert len(matches) == 1, output
    final = matches[0]
    loss, accuracy = float(final["loss"]), float(final["acc"])
    assert math.isfinite(loss)
    assert int(final["world"]) == world_size
    ckpt = Path(final["ckpt"])
    model = _load_module(DIGITS_PLAIN).Net()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    return loss, accuracy, ckpt


def test_digits_fabric_single_process_matches_plain_pytorch(tmp_path: Path) -> None:
    """On one CPU process the conversion changes nothing: same seed, same data order, same numbers."""
    # multiprocess-check: single process (devices=1)
    args = ["--epochs", "1", "--log-interval", "5"]
    plain = run_example([sys.executable, str(DIGITS_PLAIN), *args, "--out-dir", "plain"], cwd=tmp_path)
    cmd = [sys.executable, str(DIGITS_FABRIC), *args, "--accelerator", "cpu"]
    fabric = run_example([*cmd, "--out-dir", "fabric"], cwd=tmp_path)
    plain_loss, plain_acc, plain_ckpt = check_digits_run(plain, world_size=1)
    fabric_loss, fabric_acc, fabric_ckpt = check_digits_run(fabric, world_size=1)
    assert plain_acc > 30, plain  # ten classes: chance is 10%
    assert (fabric_loss, fabric_acc) == (plain_loss, plain_acc)
    _assert_same_weights(plain_ckpt, fabric_ckpt)


@needs_ddp
@pytest.mark.multiprocess
def test_digits_two_processes_launch_and_fabric_run_agree(tmp_path: Path) -> None:
    """`--devices 2 --strategy ddp` through `fabric.launch()`, and `fabric run --devices 2` with the script's
    defaults: the same DDP run either way."""
    args = ["--epochs", "2", "--log-interval", "5"]
    cmd = [sys.executable, str(DIGITS_FABRIC), "--devices", "2", "--strategy", "ddp", "--accelerator", "cpu"]
    launched = run_example([*cmd, *args, "--out-dir", "launch"], cwd=tmp_path)
    loss, accuracy, ckpt = check_digits_run(launched, world_size=2)
    assert ckpt == (tmp_path / "launch" / "digits_cnn.pt").resolve()
    test_losses = [float(x) for x in re.findall(r"\| test loss (\S+) \|", launched)]
    assert len(test_losses) == 2 and test_losses[1] < test_losses[0], launched  # it learns
    assert accuracy > 30, launched  # ten classes: chance is 10%
    # The all-reduced test counts cover the whole test set (360 images, 180 per process).
    seen = [int(m) for m in re.findall(r"\(\d+/(\d+)\)", launched)]
    assert seen and all(s == 360 for s in seen), seen

    cli = run_example([*fabric_run(), str(DIGITS_FABRIC), *args, "--out-dir", "cli"], cwd=tmp_path)
    cli_loss, cli_accuracy, cli_ckpt = check_digits_run(cli, world_size=2)
    assert (cli_loss, cli_accuracy) == (loss, accuracy)
    _assert_same_weights(ckpt, cli_ckpt)
