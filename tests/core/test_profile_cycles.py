"""``fabric.profile(schedule=...)``: rank 0's summary holds the events of every recorded step, whatever the loop's
length. torch's profiler drops a finished cycle's events when the next cycle begins, so a loop whose length is a
multiple of the cycle (the README's schedule over 4 steps) used to leave an empty table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from jobs import run_ranks

from fabric_core import Fabric

SCRIPT = Path(__file__).parent / "scripts" / "profile_cycles.py"
#: loop length -> the steps the schedule records (1 warm-up step, then 3 active, repeating)
RECORDED = {4: {1, 2, 3}, 3: {1, 2}, 6: {1, 2, 3, 5}, 8: {1, 2, 3, 5, 6, 7}}


def _check_summaries(out: Path) -> None:
    for length, recorded in RECORDED.items():
        summary = (out / f"len{length}" / "summary-rank0.txt").read_text()
        shown = {k for k in range(length) if f" step{k} " in summary}
        assert shown == recorded, (length, summary[:2000])


def test_summary_covers_every_recorded_step_in_one_process(tmp_path: Path, capsys):
    spec = importlib.util.spec_from_file_location("profile_cycles", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.profile_loops(Fabric(accelerator="cpu"), tmp_path)
    _check_summaries(tmp_path)
    assert " step3 " in capsys.readouterr().out  # printed as well


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="real processes")
def test_summary_covers_every_recorded_step_on_two_processes(tmp_path: Path):
    pytest.importorskip("fabric_ddp", reason="fabric-ddp is not installed (the XLA lane installs only fabric-xla)")
    run_ranks(SCRIPT, str(tmp_path), "ddp", "2", world_size=2, tmp_path=tmp_path, timeout=240)
    _check_summaries(tmp_path)
    assert not (tmp_path / "len4" / "summary-rank1.txt").exists()  # rank 0 alone writes it
    for rank in (0, 1):  # every rank's own traces: one per finished cycle, and one for the cycle cut short
        assert len(list((tmp_path / "len8" / f"rank{rank}").glob("*.pt.trace.json"))) == 2
