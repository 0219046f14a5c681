"""pipeline (``ModelParallelStrategy(pipeline_parallel_size=2)`` through ``fabric.forward_backward`` vs raw
``torch.distributed.pipelining``), 2 processes on CPU (gloo): steady steps/s per schedule, the measured bubble beside
the schedule's theoretical one, and the memory per rank of every parallel axis of ``model_parallel``.

How it measures: ``workers/pipeline_worker.py``. Steady: one torchrun job; for each schedule (GPipe, 1F1B,
Interleaved1F1B with 2 stages per rank) the raw loop and ours (same model, weights, data, AdamW) take turns in
rounds, steps/s from each repetition's median round; the raw rounds time every stage's compute of every micro-batch,
and the bubble is the share of the round each rank spends outside it (its median round). Memory: one job per layout
(one process, data parallel 2, tensor parallel 2, pipeline 2, sequence parallel 2), per rank the bytes of parameters,
optimizer state and gradients, and the resident memory a training step adds.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks._common import OURS, RAW, REPO_ROOT, module_available, paired_ratios, run_job, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = str(REPO_ROOT / "benchmarks" / "workers" / "pipeline_worker.py")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
LAYOUTS = {
    "single": "1 process (the whole model)",
    "dp2": "data parallel 2 (FSDP2)",
    "tp2": "tensor parallel 2 (the MLPs)",
    "pp2": "pipeline 2 (1F1B, 4 micro-batches)",
    "sp2": "sequence parallel 2 (Ulysses, FSDP2 over data x sequence)",
}
#: glibc returns freed blocks above this size to the system at once (its default threshold grows after the first
#: large free, after which RSS would keep a step's activations and hide the next step's peak).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def unavailable() -> str | None:
    if not module_available("fabric_fsdp"):
        return "`fabric_fsdp` is not importable: install fabric-fsdp (plugins/fsdp)"
    return None


def run(ctx: RunContext) -> dict[str, Any]:
    cfg, log = ctx.config, ctx.log
    timeout = cfg.get("timeout", 900)
    load_before = [round(v, 2) for v in os.getloadavg()]
    steady = run_job(
        WORKER,
        [
            "steady", "--schedules", ",".join(SCHEDULES), "--batch", str(cfg["batch"]),
            "--micro-batches", str(cfg["micro_batches"]), "--warmup", str(cfg["warmup"]), "--reps", str(cfg["reps"]),
            "--rounds", str(cfg["rounds"]), "--round-steps", str(cfg["round_steps"]),
        ],
        timeout=timeout,
    )  # fmt: skip
    out: dict[str, Any] = {
        "status": "ok",
        "model": (
            "8 residual blocks Linear(256,1024)-tanh-Linear(1024,256) as an nn.Sequential, cut into 2 stages"
            f" (4 for Interleaved1F1B, 2 per rank); batch {cfg['batch']} in {cfg['micro_batches']} micro-batches,"
            " MSE, AdamW, gloo, 1 thread per process"
        ),
        "steady": {"reps": cfg["reps"], "rounds": cfg["rounds"], "round_steps": cfg["round_steps"]},
        "schedules": {},
        "ratios": {},
        "memory": {},
    }
    for name, res in steady["schedules"].items():
        rates = res["steps_per_s"]
        bubbles = [sum(rank[i] for rank in res["bubble_per_rank"]) / len(res["bubble_per_rank"]) for i in range(cfg["reps"])]
        out["schedules"][name] = {
            "steps_per_s": {v: summarize(rates[v]) for v in (RAW, OURS)},
            "bubble_measured": summarize(bubbles),
            "bubble_per_rank": [summarize(r) for r in res["bubble_per_rank"]],
            "bubble_theoretical": res["theoretical_bubble"],
            "stages_per_rank": res["stages_per_rank"],
        }
        out["ratios"][name] = {OURS: paired_ratios(rates[OURS], rates[RAW])}
        log(
            f"  pipeline {name}: raw {summarize(rates[RAW])['median']:.2f} it/s, ours"
            f" {summarize(rates[OURS])['median']:.2f} it/s; bubble {summarize(bubbles)['median']:.2f}"
            f" (theory {res['theoretical_bubble']:.2f})"
        )
    for layout in cfg["layouts"]:
        res = run_job(WORKER, ["memory", "--layout", layout, "--seq", str(cfg["seq"])], torchrun=layout != "single", timeout=timeout, env_extra=MALLOC_ENV)
        out["memory"][layout] = res
        log(f"  memory {layout}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in res["per_rank_max_bytes"].items()))
        out["memory_model"] = res["model"]
    out["load_average"] = {"before": load_before, "after": [round(v, 2) for v in os.getloadavg()]}
    return out


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    sd = result["steady"]
    lines = [f"### pipeline (`model_parallel`, pipeline 2), 2 processes on CPU (gloo): {result['model']}", ""]
    lines.append(
        f"Steady: one torchrun job, per schedule the raw `torch.distributed.pipelining` loop and"
        f" `fabric.forward_backward` take turns ({sd['reps']} repetitions x {sd['rounds']} rounds x"
        f" {sd['round_steps']} steps; steps/s from each repetition's median round). Bubble: the share of a raw round"
        " each rank spends outside its stages' forward and backward (mean of the 2 ranks), beside the schedule's ideal"
        " (p-1)/(v m + p-1) for p ranks, m micro-batches, v stages per rank; on CPU the sends and receives of gloo and"
        " the other processes on the machine add to it (1-minute load average"
        f" {result['load_average']['before'][0]} before, {result['load_average']['after'][0]} after, on 2 cores)."
    )
    lines.append("")
    rows = []
    for name, s in result["schedules"].items():
        rows.append(
            [
                name,
                str(s["stages_per_rank"]),
                stat(s["steps_per_s"][RAW]),
                stat(s["steps_per_s"][OURS]),
                stat(result["ratios"][name][OURS]),
                stat(s["bubble_measured"]),
                f"{s['bubble_theoretical']:.3f}",
            ]
        )
    lines += table(
        ["schedule", "stages/rank", "raw steps/s", "ours steps/s", "ours / raw", "bubble measured", "bubble theory"], rows
    )
    if result.get("memory"):
        lines += ["", f"Memory per rank (the largest rank), {result.get('memory_model', '')}:", ""]
        base = result["memory"].get("single", {}).get("per_rank_max_bytes")
        rows = []
        for layout, res in result["memory"].items():
            m = res["per_rank_max_bytes"]
            kept = m["parameters"] + m["optimizer_state"]
            share = f"{kept / (base['parameters'] + base['optimizer_state']):.2f}" if base else "–"
            step = f"{m['step_peak'] / base['step_peak']:.2f}" if base and base["step_peak"] else "–"
            rows.append(
                [
                    LAYOUTS.get(layout, layout),
                    f"{m['parameters'] / 2**20:.1f}",
                    f"{m['optimizer_state'] / 2**20:.1f}",
                    f"{m['gradients'] / 2**20:.1f}",
                    share,
                    f"{m['step_peak'] / 2**20:.1f}",
                    step,
                ]
            )
        lines += table(
            ["layout", "parameters MiB", "AdamW state MiB", "gradients MiB", "kept / 1 process", "step peak MiB",
             "step peak / 1 process"],
            rows,
        )  # fmt: skip
    return "\n".join(lines)


def _target(schedule: str) -> Target:
    return Target(
        f"pipeline_{schedule}",
        f"pipeline 2 procs, {schedule}: steps/s of fabric.forward_backward / raw torch.distributed.pipelining (same job)",
        ("ratios", schedule),
        ">=",
        0.98,
        comparator=None,
    )


SECTION = Section(
    name="pipeline",
    order=46,
    modes={
        "full": {"batch": 64, "micro_batches": 4, "warmup": 3, "reps": 7, "rounds": 8, "round_steps": 3, "layouts": list(LAYOUTS), "seq": 512},
        "quick": {"batch": 64, "micro_batches": 4, "warmup": 2, "reps": 3, "rounds": 4, "round_steps": 3, "layouts": list(LAYOUTS), "seq": 512},
        "tiny": {"batch": 8, "micro_batches": 4, "warmup": 1, "reps": 1, "rounds": 1, "round_steps": 1, "layouts": ["single", "pp2"], "seq": 64},
    },
    run=run,
    render=render,
    unavailable=unavailable,
    compares_lightning=False,
    targets=tuple(_target(s) for s in SCHEDULES),
)
