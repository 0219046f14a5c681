"""The rank-zero progress bar: plain lines at a bounded rate in logs, a tqdm bar in terminals, silent elsewhere."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from fabric_core.runtime.progress import ProgressBar
from fabric_core.utilities import rank_zero


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class CountingLoss:
    """A loss whose conversion to a number is counted (on a GPU each conversion is a device synchronisation)."""

    def __init__(self, value: float) -> None:
        self.value, self.items = value, 0

    def item(self) -> float:
        self.items += 1
        return self.value


def test_logs_get_a_line_at_the_start_then_at_most_every_interval_and_at_the_end():
    out = io.StringIO()
    loss = CountingLoss(2.5)
    with ProgressBar(total=200, desc="train", items_unit="tokens", log_every_s=3600, file=out) as bar:
        for _ in range(200):
            bar.update(loss=loss, items=512)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines  # not one per step
    assert lines[0].startswith("train step 1/200 (0%) | loss 2.5 |")
    assert lines[1].startswith("train step 200/200 (100%) | loss 2.5 | ")
    assert "step/s, " in lines[1] and "tokens/s (average)" in lines[1] and "\r" not in out.getvalue()
    assert loss.items == 2  # converted only for the two lines shown


def test_lines_repeat_with_the_interval(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("fabric_core.runtime.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = ProgressBar(total=None, desc="eval", unit="batch", log_every_s=10, file=out)
    for _ in range(25):
        bar.update(acc=0.5)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["eval batch 1", "eval batch 11", "eval batch 21", "eval batch 25"]
    assert "1 batch/s" in lines[1] and "left" not in lines[1]  # no total: no time left


def test_terminal_gets_a_tqdm_bar_with_the_fields(monkeypatch):
    pytest.importorskip("tqdm")
    # Half a second per clock read: a rate over less than 1 ms is not shown, and three real updates can take less.
    clock = iter(0.5 * t for t in range(1000))
    monkeypatch.setattr("fabric_core.runtime.progress.time.perf_counter", lambda: next(clock))
    out = Terminal()
    with ProgressBar(total=3, desc="train", items_unit="tokens", refresh_s=0, file=out) as bar:
        for step in range(3):
            bar.update(loss=torch.tensor(1.0 / (step + 1)), items=100)
    text = out.getvalue()
    assert "train" in text and "3/3" in text and "loss=0.3333" in text and "tokens/s=" in text


@pytest.mark.parametrize("enabled", [None, False])
def test_silent_on_other_ranks_and_when_disabled(monkeypatch, enabled):
    monkeypatch.setattr(rank_zero._RankHolder, "rank", 1 if enabled is None else 0)
    out = Terminal()
    bar = ProgressBar(total=5, enabled=enabled, file=out)
    for _ in range(5):
        bar.update(loss=1.0)
    bar.close()
    assert out.getvalue() == "" and bar.n == 0 and bar._bar is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="`total` must be"):
        ProgressBar(total=-1)
    with pytest.raises(ValueError, match="`log_every_s` must be positive"):
        ProgressBar(log_every_s=0)


def test_importing_it_does_not_import_tqdm():
    code = "import sys, fabric_core.runtime.progress; assert 'tqdm' not in sys.modules, 'tqdm imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
