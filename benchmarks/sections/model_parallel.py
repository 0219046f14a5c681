"""model_parallel (fabric-fsdp's ``ModelParallelStrategy`` vs a raw ``parallelize_module`` + ``fully_shard`` loop),
2 processes on CPU (gloo), data parallel 1 x tensor parallel 2: steady steps/s and time to first step.

How it measures: ``_data_parallel.py`` (shared with the ``ddp`` and ``fsdp`` sections) with
``workers/model_parallel_worker.py``: one torchrun job in which both variants of the same model (same weights, data,
AdamW) take turns in rounds, and fresh jobs per variant for the first step (a job that fails is recorded and left
out of the pairs). lightning-fabric's ``ModelParallelStrategy`` (it runs on CPU) takes its turn in the steady job and
has its own first-step jobs in the full run.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import LIGHTNING, OURS, RAW
from benchmarks.section import RenderContext, RunContext, Section
from benchmarks.sections import _data_parallel


def run(ctx: RunContext) -> dict[str, Any]:
    return _data_parallel.run("model_parallel", ctx)


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    return _data_parallel.render("model_parallel (tensor parallel x FSDP2)", result)


SECTION = Section(
    name="model_parallel",
    order=45,
    modes={
        "full": {
            "first_step_reps": 3,
            "warmup": 5,
            "steady_reps": 7,
            "rounds": 20,
            "round_steps": 3,
            "first_step_variants": [RAW, OURS, "ours_launch", LIGHTNING],
        },
        "quick": {
            "first_step_reps": 1,
            "warmup": 3,
            "steady_reps": 3,
            "rounds": 6,
            "round_steps": 3,
            "first_step_variants": [RAW, OURS],
            "lightning": False,  # its import costs seconds in every fresh job
        },
        "tiny": {
            "first_step_reps": 1,
            "warmup": 1,
            "steady_reps": 1,
            "rounds": 1,
            "round_steps": 1,
            "first_step_variants": [RAW, OURS],
            "lightning": False,
        },
    },
    run=run,
    render=render,
    unavailable=lambda: _data_parallel.unavailable("model_parallel"),
    targets=(
        _data_parallel.steady_target(
            "model_parallel", "model_parallel", raw="raw `parallelize_module` + `fully_shard`", bound=0.98
        ),
    ),
)
