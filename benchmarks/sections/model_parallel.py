"""model_parallel (fabric-fsdp's ``ModelParallelStrategy`` vs a raw ``parallelize_module`` + ``fully_shard`` loop),
2 processes on CPU (gloo), tensor parallel 2: steady steps/s.

How it measures: one torchrun job (``workers/model_parallel_worker.py``) holds both variants of the same model (two
residual MLP blocks, each split column-then-row over the tensor-parallel ranks, then FSDP2 over the data-parallel
row); they take turns in short rounds, so each pair of rounds sees the same machine. lightning-fabric is not
compared: its ``ModelParallelStrategy`` refuses the CPU.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import OURS, RAW, REPO_ROOT, module_available, paired_ratios, run_job, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = str(REPO_ROOT / "benchmarks" / "workers" / "model_parallel_worker.py")
MODEL = "2 residual blocks of Linear(512,1024)-ReLU-Linear(1024,512), batch 32, AdamW, tensor parallel 2 x FSDP2"


def run(ctx: RunContext) -> dict[str, Any]:
    cfg = ctx.config
    variants = [RAW, OURS]
    job = run_job(
        WORKER,
        [
            "--variants", ",".join(variants), "--warmup", str(cfg["warmup"]), "--reps", str(cfg["reps"]),
            "--rounds", str(cfg["rounds"]), "--round-steps", str(cfg["round_steps"]),
        ],
        timeout=cfg.get("timeout", 900),
    )  # fmt: skip
    rates = job["steps_per_s"]
    ctx.log("  model_parallel steady: " + ", ".join(f"{v} {summarize(rates[v])['median']:.1f} it/s" for v in variants))
    return {
        "status": "ok",
        "model": MODEL,
        "how": "one torchrun job, variants take turns in rounds; steps/s from each repetition's median round",
        "reps": cfg["reps"],
        "rounds_per_rep": cfg["rounds"],
        "round_steps": cfg["round_steps"],
        "threads_per_process": job["threads"],
        "variants": {v: {"steady_steps_per_s": summarize(rates[v])} for v in variants},
        "steady_ratios": {OURS: paired_ratios(rates[OURS], rates[RAW])},
        "exit_aborted": bool(job.get("exit_aborted")),
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    lines = [f"### model_parallel, 2 processes on CPU (gloo): {result['model']}", ""]
    lines.append(
        f"Steady: {result['how']} ({result['reps']} repetitions x {result['rounds_per_rep']} rounds x"
        f" {result['round_steps']} steps, {result['threads_per_process']} thread(s) per process)."
    )
    lines.append("")
    rows = [
        [v, stat(e["steady_steps_per_s"]), "1" if v == RAW else stat(result["steady_ratios"].get(v))]
        for v, e in result["variants"].items()
    ]
    lines += table(["variant", "steady steps/s", "steady ratio"], rows)
    return "\n".join(lines)


def unavailable() -> str | None:
    if not module_available("fabric_fsdp"):
        return "`fabric_fsdp` is not importable: install fabric-fsdp (plugins/fsdp)"
    return None


SECTION = Section(
    name="model_parallel",
    order=45,
    modes={
        "full": {"warmup": 5, "reps": 7, "rounds": 12, "round_steps": 3},
        "quick": {"warmup": 3, "reps": 3, "rounds": 6, "round_steps": 3},
        "tiny": {"warmup": 1, "reps": 1, "rounds": 1, "round_steps": 1},
    },
    run=run,
    render=render,
    unavailable=unavailable,
    compares_lightning=False,
    targets=(
        Target(
            "model_parallel_steady",
            "model_parallel 2 procs: steady steps/s / raw parallelize_module + fully_shard (same job, taking turns)",
            ("steady_ratios",),
            ">=",
            0.98,
        ),
    ),
)
