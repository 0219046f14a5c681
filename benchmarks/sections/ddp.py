"""DDP, 2 processes on CPU (gloo): steady steps/s and time to first step, ours vs a raw torchrun script.

How it measures: ``_data_parallel.py`` (shared with the ``fsdp`` section).
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import OURS, RAW
from benchmarks.section import RenderContext, RunContext, Section, Target
from benchmarks.sections import _data_parallel


def run(ctx: RunContext) -> dict[str, Any]:
    return _data_parallel.run("ddp", ctx)


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    return _data_parallel.render("DDP", result)


SECTION = Section(
    name="ddp",
    order=30,
    modes={
        "full": {"first_step_reps": 5, "warmup": 10, "steady_reps": 7, "rounds": 20, "round_steps": 3},
        "quick": {
            "first_step_reps": 1,
            "warmup": 5,
            "steady_reps": 2,
            "rounds": 6,
            "round_steps": 3,
            "first_step_variants": [RAW, OURS],
            # lightning-fabric's import costs seconds in every fresh job: compared in the full run only.
            "lightning": False,
        },
        "tiny": {
            "first_step_reps": 1,
            "warmup": 1,
            "steady_reps": 1,
            "rounds": 1,
            "round_steps": 1,
            "first_step_variants": [RAW, OURS, "ours_launch"],
            "lightning": False,
        },
    },
    run=run,
    render=render,
    unavailable=lambda: _data_parallel.unavailable("ddp"),
    targets=(
        _data_parallel.steady_target("ddp", "DDP"),
        Target(
            "ddp_first_step",
            "DDP 2 procs: time to first step / torchrun script (under torchrun)",
            ("first_step_ratios",),
            "<=",
            1.05,
        ),
        Target(
            "ddp_first_step_launch",
            "DDP 2 procs: time to first step / torchrun script (`fabric.launch()`)",
            ("first_step_ratios",),
            "<=",
            1.05,
            variant="ours_launch",
            comparator=None,
        ),
    ),
)
