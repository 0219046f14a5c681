"""The sample ledger (``FABRIC_SAMPLE_LEDGER``): what a process writes, how a run's files are replayed (a resume rolls
back what was trained after its checkpoint), and ``fabric ledger``'s report and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric
from fabric_core.cli import main as cli
from fabric_core.runtime import ledger
from fabric_core.runtime.ledger import report


@pytest.fixture(autouse=True)
def _fresh_ledger(monkeypatch: pytest.MonkeyPatch):
    yield
    if ledger.open_ledger is not None:
        ledger.open_ledger.close()
    ledger.open_ledger = None
    ledger._open_folder = None


def _write(folder: Path, name: str, events: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"samples-{name}.jsonl").open("w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def _step(t: float, epoch: int, start: int, end: int, share: int, shares: int, indices: list[int], size: int = 8) -> dict:
    return {"kind": "step", "loader": "loader0", "epoch": epoch, "start": start, "end": end, "share": share,
            "shares": shares, "indices": indices, "padding": 0, "size": size, "t": t}  # fmt: skip


def test_a_resume_rolls_back_what_was_trained_after_its_checkpoint(tmp_path: Path):
    # 2 ranks, global batch 4: steps [0,4) and [4,8); the job dies after step 2, whose checkpoint was taken after
    # step 1: a single process resumes at position 4 and trains [4,8) again.
    _write(tmp_path, "a0", [_step(1, 0, 0, 4, 0, 2, [10, 12]), _step(3, 0, 4, 8, 0, 2, [14, 16])])
    _write(tmp_path, "a1", [_step(2, 0, 0, 4, 1, 2, [11, 13]), _step(4, 0, 4, 8, 1, 2, [15, 17])])
    _write(tmp_path, "b0", [{"kind": "resume", "loader": "loader0", "epoch": 0, "position": 4, "size": 8, "t": 5},
                            _step(6, 0, 4, 8, 0, 1, [14, 15, 16, 17])])  # fmt: skip
    result = report(tmp_path)
    assert result.ok and result.rolled_back == 2, result.text()
    epoch = result.as_dict()["loaders"]["loader0"]["epochs"]["0"]
    assert (epoch["trained"], epoch["lost"], epoch["duplicated"]) == (8, [], {})
    assert result.resumes == {"loader0": [(0, 4)]}
    assert cli(["ledger", str(tmp_path)]) == 0


def test_lost_and_duplicated_positions_are_reported_and_fail_the_command(tmp_path: Path, capsys: pytest.CaptureFixture):
    # resumed at position 6 of a run that had reached only 4 (positions 4 and 5 lost), and positions 2 and 3 trained
    # again later without a resume going back to them (trained twice)
    _write(tmp_path, "a", [_step(1, 0, 0, 4, 0, 1, [0, 1, 2, 3]),
                           {"kind": "resume", "loader": "loader0", "epoch": 0, "position": 6, "size": 8, "t": 2},
                           _step(3, 0, 6, 8, 0, 1, [6, 7]),
                           _step(4, 0, 2, 4, 0, 1, [2, 3])])  # fmt: skip
    result = report(tmp_path)
    epoch = result.loaders["loader0"][0]
    assert epoch.lost == [4, 5] and epoch.duplicated == {2: 2, 3: 2} and not result.ok
    assert cli(["ledger", str(tmp_path), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is False and printed["loaders"]["loader0"]["epochs"]["0"]["lost"] == [4, 5]
    assert cli(["ledger", str(tmp_path / "nothing")]) == 2
    assert "No ledger folder" in capsys.readouterr().err


def test_a_process_records_the_batches_it_stepped_on_in_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``FABRIC_SAMPLE_LEDGER=1``: the run folder's ``samples/``; a batch counts once an optimizer step follows it."""
    monkeypatch.setenv("FABRIC_SAMPLE_LEDGER", "1")
    fabric = Fabric(accelerator="cpu", devices=1, run_dir=tmp_path / "run")
    data = TensorDataset(torch.arange(12.0).unsqueeze(1))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=True), global_batch_size=4)
    net = torch.nn.Linear(1, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = []
    for (x,) in loader:
        seen.append(x.flatten().tolist())
        fabric.backward(model(x).sum())
        optimizer.step()
        if len(seen) == 2:
            break
    next(iter(loader))  # handed out, never stepped on: not trained
    folder = tmp_path / "run" / "samples"
    files = list(folder.glob("samples-rank0-*.jsonl"))
    assert len(files) == 1
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert lines[0]["kind"] == "open" and lines[0]["attempt"] == 0 and lines[0]["run"] == fabric.run_info.id
    steps = [line for line in lines if line["kind"] == "step"]
    assert [s["indices"] for s in steps] == [[int(v) for v in batch] for batch in seen]
    assert [(s["start"], s["end"], s["optimizer_step"]) for s in steps] == [(0, 4, 1), (4, 8, 2)]
    assert (tmp_path / "run" / "run.json").is_file(), "the run folder records the attempt"
    assert cli(["ledger", str(tmp_path / "run")]) == 0
