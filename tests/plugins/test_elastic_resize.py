"""Elastic resize by restarts: a run trained on 4 ranks, resumed on 2, then on 3 (ranks started externally, gloo on
CPU), ddp and fsdp (DCP reshards the model and optimizer; the loader's global position and the random generators go
with them). Every run stops between two checkpoints, so the steps after the last one are trained again after the
resume. The sample ledger decides: every sample of both epochs trained exactly once (pads apart). With a fixed
global batch of 24 the final weights equal an uninterrupted 4-rank run's to 1e-6 (float64, SGD).

Each process runs three trainings one after the other (``scripts/elastic_train.py``): ``kept`` (the per-rank batch
of 4 kept), ``fixed`` (``global_batch_size=24``) and, on 4 ranks, the uninterrupted ``fixed-ref``. The fsdp job's
processes also run ``model_parallel`` on 4 and then 2 of them (data-parallel size 2 -> 1, a model axis of 2 kept):
``tp`` (data x tensor parallel) and ``pp`` (pipeline x data parallel), in the same processes because starting
processes is most of what these tests cost.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from jobs import run_ranks

from fabric_core.runtime.ledger import report

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="uses /proc"),
    pytest.mark.skipif(importlib.util.find_spec("torchdata") is None, reason="needs torchdata's StatefulDataLoader"),
]

TRAIN = Path(__file__).parent / "scripts" / "elastic_train.py"
#: (world size, the runs of that restart and the step each stops after): 96 samples, 2 epochs. kept: 6 steps an epoch on
#: 4 ranks, 12 on 2, 8 on 3; stopped after steps 5 and 13 (checkpoints every 2 steps: resumed at 4 = position 64,
#: then at 12 = epoch 1, position 32, which 3 ranks finish with 2 pads). fixed: 4 steps an epoch; stopped after 3 and 5.
RESTARTS = ((4, ("fixed-ref", "kept:5", "fixed:3")), (2, ("kept:13", "fixed:5")), (3, ("kept", "fixed")))
#: model_parallel's runs in the fsdp job's first two restarts, per-rank batch of 4 kept: 12 steps an epoch at data-parallel
#: size 2 (4 ranks), 24 at 1 (2 ranks); stopped after step 15 (resumed at 14 = epoch 1, position 16). 3 ranks cannot
#: hold a model axis of 2: growing is the same DCP load, which fsdp's 2 -> 3 shows.
MODEL_PARALLEL = {4: ("tp:15", "pp:15"), 2: ("tp", "pp")}


def _progress(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "progress.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_four_two_three_ranks_train_every_sample_once_and_a_fixed_global_batch_trains_like_four(tmp_path: Path, strategy: str):
    pytest.importorskip(f"fabric_{strategy}")
    for world, runs in RESTARTS:
        runs += MODEL_PARALLEL.get(world, ()) if strategy == "fsdp" else ()
        outputs = run_ranks(TRAIN, str(tmp_path), strategy, *runs, world_size=world, timeout=300, tmp_path=tmp_path)
        for run in runs:
            name, _, stop = run.partition(":")
            assert f"RUN {name} {'stopped' if stop else 'done'} world={world}" in outputs[0], outputs[0][-3000:]

    for name, resumes in (("kept", [[0, 64], [1, 32]]), ("fixed", [[0, 48], [0, 96]]), ("fixed-ref", [])):
        ledger = report(tmp_path / name / "ledger")
        summary = ledger.as_dict()["loaders"]["loader0"]
        assert ledger.ok, ledger.text()
        assert summary["resumes"] == resumes, ledger.text()
        for epoch in ("0", "1"):
            assert summary["epochs"][epoch]["trained"] == summary["epochs"][epoch]["size"] == 96, ledger.text()
        if resumes:
            assert ledger.rolled_back > 0, "the steps after the last checkpoint were trained twice, once rolled back"
    # kept: epoch 1 was finished by 3 ranks from position 32 (64 samples: 5 steps of 12, then 4 padded to 6)
    assert report(tmp_path / "kept" / "ledger").loaders["loader0"][1].padding == 2

    # every restart really ran at its size, from the checkpoint before the stop
    kept = _progress(tmp_path / "kept")
    starts = [(r["resumed"], r["world"]) for r in kept if "resumed" in r]
    assert starts == [(0, 4), (4, 2), (12, 3)], starts
    # after a resize, every rank's generators come from the checkpoint and its data-parallel rank: all different; the
    # loaded model and optimizer state, gathered whole, is the saved one to the bit
    for record in kept:
        if "resumed" in record and record["resumed"]:
            assert len(set(record["draws"])) == record["world"], record
            assert record["state"]["differ"] == {} and record["state"]["keys"] == 4, record

    reference = torch.load(tmp_path / "fixed-ref" / "final.pt", weights_only=True)
    resized = torch.load(tmp_path / "fixed" / "final.pt", weights_only=True)
    assert reference.keys() == resized.keys() and reference
    for key, value in reference.items():
        assert torch.allclose(value, resized[key], rtol=0, atol=1e-6), f"{key}: {(value - resized[key]).abs().max()}"
    # and the kept run trained something else (a different global batch): the check above can fail
    kept_weights = torch.load(tmp_path / "kept" / "final.pt", weights_only=True)
    assert any(not torch.allclose(value, kept_weights[key], atol=1e-6) for key, value in reference.items())
    if strategy == "fsdp":
        _check_model_parallel(tmp_path)


def _check_model_parallel(tmp_path: Path) -> None:
    """model_parallel resumed at another data-parallel size (2 -> 1; tensor and pipeline axes kept at 2): DCP reshards
    the DTensor shards of the model and of AdamW's state, and what the resume loaded, gathered whole, is the saved
    state to the bit; the sample ledger counts each data-parallel share once (model-axis peers train the same samples)
    and finds every sample of both epochs trained once; the generators come from the checkpoint and the data-parallel
    rank (model-axis peers draw alike)."""
    for name in ("tp", "pp"):
        ledger = report(tmp_path / name / "ledger")
        summary = ledger.as_dict()["loaders"]["loader0"]
        assert ledger.ok and summary["resumes"] == [[1, 16]], ledger.text()
        for epoch in ("0", "1"):
            assert summary["epochs"][epoch]["trained"] == summary["epochs"][epoch]["size"] == 96, ledger.text()
        assert ledger.rolled_back > 0
        starts = [r for r in _progress(tmp_path / name) if "resumed" in r]
        assert [(r["resumed"], r["world"]) for r in starts] == [(0, 4), (14, 2)], starts
        # 2 Linear layers: 4 parameters, each with AdamW's step, exp_avg and exp_avg_sq
        assert starts[1]["state"] == {"keys": 16, "differ": {}}, starts[1]
        # resumed: both ranks (one data-parallel rank) draw alike, not what a fresh process draws (the first start's)
        assert len(set(starts[1]["draws"])) == 1 and not set(starts[1]["draws"]) & set(starts[0]["draws"]), starts
