"""fabric-deepspeed with the real deepspeed package on real processes (gloo on CPU).

The expensive part is starting ranks and building engines, so each multi-process test runs one worker script that
does many checks and writes its measurements to JSON; the assertions live here. Scripts are in ``scripts/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs import read_json, run_ranks

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.append(str(SCRIPTS))  # for ds_common; appended so nothing else is shadowed
import ds_common as common  # noqa: E402


def test_stages_precisions_offload_and_the_seeds_rules(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "train_checks.py", str(tmp_path), timeout=240, tmp_path=tmp_path)
    r = read_json(tmp_path / "train.json")
    assert r["world_size"] == 2
    runs = r["runs"]
    reference = common.reference_losses(6, 2, accumulate_at=2)
    # float32: every stage, with and without offload, is the single-process reference on the global batch (the
    # stage-2 run accumulates two micro-batches at step 2, which must not change anything).
    for name in ("stage1_fp32", "stage2_fp32", "stage3_fp32", "stage2_offload", "stage3_offload"):
        assert runs[name]["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6), name
        assert runs[name]["param_dtype"] == "torch.float32", name
    for name, run in runs.items():
        assert run["losses"][-1] < 0.8 * run["losses"][0], name  # training works
        assert run["precision"] == "DeepSpeedPrecision", name
        assert run["optimizer"] == "FabricOptimizer", name
        assert run["engine_steps"] == 6, name  # every optimizer.step() is an optimizer step
        assert run["managed_accumulation"] is False, name
    # bf16: the engine holds bf16 parameters, inputs are cast for it and outputs come back as float32.
    for name in ("stage2_bf16", "stage3_bf16", "stage3_bf16_true"):
        assert runs[name]["param_dtype"] == "torch.bfloat16", name
        assert runs[name]["output_dtype"] == "torch.float32", name
        assert runs[name]["losses"] == pytest.approx(reference, rel=2e-2), name

    # Several models: backward needs `model=`, and each optimizer steps its own engine.
    errors = r["errors"]
    assert errors["backward_without_model"] == "No models were set up for backward. Did you forget to call `fabric.setup()`?"
    assert errors["ambiguous_backward"].startswith(
        "When using multiple models + deepspeed, please provide the model used to perform the optimization:"
        " `self.backward(loss, model=model)`"
    )
    assert r["step_moves_only_its_model"] == {"a_changed": False, "b_changed": True}
    assert r["a_changed_after_its_step"]
    assert "`fabric.backward(loss)` instead of `loss.backward()`" in errors["plain_backward"]
    assert r["no_backward_sync_warnings"] == [
        "The `DeepSpeedStrategy` does not support skipping the gradient synchronization. Remove"
        " `.no_backward_sync()` from your code or choose a different strategy."
    ]
    for key in ("clip_norm", "clip_value"):
        assert errors[key].startswith("DeepSpeed handles gradient clipping automatically within the optimizer.")
        assert "'gradient_clipping'" in errors[key]
    assert errors["setup_optimizers"].startswith(
        "The `DeepSpeedStrategy` requires the model and optimizer(s) to be set up jointly through `.setup(model,"
        " optimizer, ...)`."
    )
    assert "Got 2 optimizers instead" in errors["two_optimizers"]
    assert "closure" in errors["closure"]

    # A model set up alone evaluates exactly like the plain model (stage 3: partitioned, gathered per forward).
    assert r["setup_module_stage2_diff"] == 0.0 and r["setup_module_stage3_diff"] == 0.0
    # init_module under stage 3: nothing is held locally; each rank holds half of every parameter.
    zero_init = r["zero_init"]
    assert zero_init["local_numel"] == 0 and zero_init["partition_numel"] * 2 >= zero_init["full_numel"]
    assert zero_init["partition_numel"] <= zero_init["full_numel"] / 2 + 16
    assert "empty_init=False" in errors["empty_init_false"]
    assert "nvme_path='/local_nvme'" in errors["nvme_path"] and "not a writable directory" in errors["nvme_path"]
