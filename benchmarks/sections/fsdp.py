"""FSDP (fabric-fsdp vs raw FSDP2 ``fully_shard``), 2 processes on CPU (gloo): steady steps/s and time to first step.

How it measures: ``_data_parallel.py`` (shared with the ``ddp`` section). lightning-fabric is not compared: it
refuses FSDP on CPU.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import OURS, RAW
from benchmarks.section import RenderContext, RunContext, Section
from benchmarks.sections import _data_parallel


def run(ctx: RunContext) -> dict[str, Any]:
    return _data_parallel.run("fsdp", ctx)


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    return _data_parallel.render("FSDP", result)


SECTION = Section(
    name="fsdp",
    order=40,
    modes={
        "full": {"first_step_reps": 5, "warmup": 10, "steady_reps": 7, "rounds": 20, "round_steps": 3},
        "quick": "not run in --quick mode (run `python -m benchmarks` for it)",
        "tiny": {
            "first_step_reps": 1,
            "warmup": 1,
            "steady_reps": 1,
            "rounds": 1,
            "round_steps": 1,
            "first_step_variants": [RAW, OURS],
        },
    },
    run=run,
    render=render,
    unavailable=lambda: _data_parallel.unavailable("fsdp"),
    compares_lightning=False,
    targets=(_data_parallel.steady_target("fsdp", "FSDP"),),
)
