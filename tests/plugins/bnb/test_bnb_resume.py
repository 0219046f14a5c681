"""Resuming a quantized model is exact in every mode: after ``fabric.save`` and ``fabric.load`` into a model built
from another seed, the next 3 steps are bit-identical to those of the model that was saved (``scripts/bnb_resume.py``),
in one process and on 2 DDP ranks. int8 training used to drift (up to 9e-3 after a step): its load replaced the
weight parameter, so the optimizer (and DDP) stepped a parameter the model no longer used."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from jobs import run_ranks

pytest.importorskip("bitsandbytes", reason="fabric-bnb's tests need bitsandbytes (pip install fabric-bnb)")

from fabric_core import Fabric  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "bnb_resume.py"
_spec = importlib.util.spec_from_file_location("bnb_resume", SCRIPT)
bnb_resume = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bnb_resume)
MODES = bnb_resume.MODES


def _check(result: dict, mode: str) -> None:
    assert result["fresh_differed"] and result["moved"] > 1e-4, result  # the comparison is not trivially equal
    assert result["diffs"] == [0.0, 0.0, 0.0], result
    adapters = mode != "int8-training"
    assert any(".a" in name for name in result["names"]) is adapters, result["names"]


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_exact_in_one_process(tmp_path: Path, mode: str):
    fabric = Fabric(accelerator="cpu", precision="bnb-" + mode)
    _check(bnb_resume.resume_check(fabric, mode, tmp_path / "ckpt.pt"), mode)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    """One 2-rank DDP job resumes every mode in turn (one process pair for all six: cheaper than six jobs)."""
    pytest.importorskip("fabric_ddp", reason="the DDP checks need fabric-ddp")
    out = tmp_path_factory.mktemp("bnb_resume_ddp")
    run_ranks(SCRIPT, str(out), *MODES, world_size=2, timeout=400, tmp_path=out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_exact_on_two_ddp_ranks(ddp_results: list[dict], mode: str):
    for rank_results in ddp_results:
        result = rank_results[mode]
        _check(result, mode)
        assert result["synced"], result  # the ranks hold the same weights after the resumed steps


@pytest.mark.parametrize("mode", ["nf4", "fp4-dq"])
@pytest.mark.parametrize("sizes", [(16, 24, 3), (64, 64, 32)], ids=["small", "tiled"])
def test_an_evaluation_changes_nothing_in_a_4bit_model(mode: str, sizes: tuple[int, int, int]):
    """bitsandbytes' CPU inference repacking (at an eval() forward without gradients) fails for small layers and
    changes the quantization state of the others for good (bfloat16 block scales, double quantization dropped):
    evaluation must compute what training computes and leave the model's state as it was."""
    import torch
    from torch import nn

    fabric = Fabric(accelerator="cpu", precision="bnb-" + mode)
    torch.manual_seed(0)
    model = fabric.setup(nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.ReLU(), nn.Linear(sizes[1], sizes[2])))
    x = torch.randn(5, sizes[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        training_result = model(x)
        model.eval()
        assert torch.equal(model(x), training_result)
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in state.items())
