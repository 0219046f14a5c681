"""A script written for the well-known Fabric runs with only its imports changed (scripts/reference_style.py).

On 2 processes with ddp, fsdp and deepspeed, and on one process: a model compiled before ``setup``,
``no_backward_sync`` over micro-batches, gradient clipping, ``ThroughputMonitor`` with ``measure_flops``, a
duck-typed logger class defined in the script, save and load. The weights after training must match the same steps
in one plain process, so accumulation (no gradient sync until the last micro-batch) and clipping really happened.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import run_script

SCRIPT = Path(__file__).parent / "scripts" / "reference_style.py"
#: FLOPs of one micro-batch of the script's model, forward and backward: 3 matmul passes (forward, gradient of the
#: input, gradient of the weight) of 2*B*T*in*out each over the three linear layers (2 x 16 tokens), except that the
#: embedding has no matmul.
TOKENS = 2 * 16
FLOPS_PER_BATCH = 3 * 2 * TOKENS * (32 * 128 + 128 * 32 + 32 * 64)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("ddp", 2), ("fsdp", 2), ("deepspeed", 2), ("auto", 1)],
)
def test_reference_style_script(tmp_path: Path, strategy: str, devices: int) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("fabric_deepspeed")
    run_script(SCRIPT, strategy, str(devices), str(tmp_path), timeout=420, tmp_path=tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]
    for result in results:
        assert result["world_size"] == devices
        assert result["compiled_after_setup"] == "OptimizedModule"  # re-applied over the strategy's module
        # AdamW moves every weight by about lr (1e-2) per step: gradients missing a sync or a clip would show at that
        # scale; what remains is float summation order.
        assert result["max_diff_reference"] < 1e-4, result
        assert result["max_diff_loaded"] == 0.0
        assert result["iter_num"] == 3
        assert result["flops_per_batch"] == FLOPS_PER_BATCH
        assert result["available_flops"] is None  # the CPU has no peak: no MFU
        assert result["finalized"] == "success"
    # rank 0's logger got the hyperparameters and one line of throughput metrics per optimizer step
    lines = [json.loads(line) for line in (tmp_path / "metrics.rank0.jsonl").read_text().splitlines()]
    assert lines[0] == {"hparams": {"strategy": strategy, "micro_batch": 2}}
    metrics = lines[1:]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [m["batches"] for m in metrics] == [1, 2, 3] and metrics[-1]["lengths"] == 3 * 2 * 2 * 16
    assert "device/flops_per_sec" not in metrics[0]  # the window (2 updates) fills at the second step
    assert metrics[-1]["device/flops_per_sec"] > 0 and "device/mfu" not in metrics[-1]
    if devices > 1:
        assert metrics[-1]["samples_per_sec"] == pytest.approx(2 * metrics[-1]["device/samples_per_sec"])
        # ThroughputMonitor logs from rank 0 only
        assert not (tmp_path / "metrics.rank1.jsonl").exists() or "step" not in (tmp_path / "metrics.rank1.jsonl").read_text()
