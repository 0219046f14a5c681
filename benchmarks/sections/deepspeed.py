"""DeepSpeed ZeRO stages 2 and 3, 2 processes on CPU (gloo): steady steps/s, ours vs a raw DeepSpeed engine.

One torchrun job per stage (``workers/deepspeed_worker.py``) holds a raw ``deepspeed.initialize`` engine and the same model
set up through ``Fabric(strategy="deepspeed_stage_N")``, with the same config (the job checks it); they take turns
in short rounds, as in the DDP/FSDP sections. Ratios are paired within a repetition.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import (
    OURS,
    RAW,
    REPO_ROOT,
    dist_version,
    module_available,
    paired_ratios,
    run_job,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = str(REPO_ROOT / "benchmarks" / "workers" / "deepspeed_worker.py")
STAGES = (2, 3)


def unavailable() -> str | None:
    if not module_available("fabric_deepspeed"):
        return "`fabric_deepspeed` is not importable: install fabric-deepspeed (plugins/deepspeed)"
    if not module_available("deepspeed"):
        return "`deepspeed` is not importable: install fabric-deepspeed (plugins/deepspeed), it depends on it"
    return None


def run(ctx: RunContext) -> dict[str, Any]:
    cfg, log = ctx.config, ctx.log
    timeout = cfg.get("timeout", 600)
    out: dict[str, Any] = {
        "status": "ok",
        "model": "3 x Linear(512,512) with ReLU, batch 64 per process, AdamW, float32, gloo",
        "deepspeed": dist_version("deepspeed"),
        "steady": {
            "how": "one torchrun job per stage, raw engine and ours take turns in rounds; steps/s from each"
            " repetition's median round",
            "raw": "deepspeed.initialize(model, optimizer, config) with the config the strategy builds; loop:"
            " engine(x), engine.backward(loss), engine.step()",
            "ours": "Fabric(strategy='deepspeed_stage_N'); loop: model(x), fabric.backward(loss), optimizer.step(),"
            " optimizer.zero_grad()",
            "reps": cfg["reps"],
            "rounds_per_rep": cfg["rounds"],
            "round_steps": cfg["round_steps"],
        },
        "stages": {},
        "steady_ratios": {},
    }
    for stage in STAGES:
        res = run_job(
            WORKER,
            [
                "--stage", str(stage), "--warmup", str(cfg["warmup"]), "--reps", str(cfg["reps"]),
                "--rounds", str(cfg["rounds"]), "--round-steps", str(cfg["round_steps"]),
            ],
            timeout=timeout,
        )  # fmt: skip
        if res["jit_ops_loaded"]:
            raise RuntimeError(
                f"stage {stage}: DeepSpeed JIT-compiled ops were loaded: {res['jit_ops_loaded']}"
            )
        rates = res["steps_per_s"]
        key = f"stage_{stage}"
        ratio = paired_ratios(rates[OURS], rates[RAW])
        out["stages"][key] = {
            "strategy": f"deepspeed_stage_{stage}",
            "threads_per_process": res["threads"],
            "config": res["config"],
            "setup_s": res["setup_s"],
            "variants": {v: {"steady_steps_per_s": summarize(rates[v])} for v in (RAW, OURS)},
            # A cross-check less sensitive to load changes between rounds: per repetition, the median over rounds
            # of ours' steps/s / raw's in the same round.
            "round_paired_ratio": summarize(res["round_paired_ratios"]),
        }
        # Keyed "ours" under each stage, as the other sections' ratio dicts, so a target can point at one stage.
        out["steady_ratios"][key] = {OURS: ratio}
        log(
            f"  deepspeed stage {stage}: raw {summarize(rates[RAW])['median']:.1f} it/s,"
            f" ours {summarize(rates[OURS])['median']:.1f} it/s, ratio {ratio['median']:.3f}"
            f" [{ratio['min']:.3f}-{ratio['max']:.3f}]; round-paired"
            f" {out['stages'][key]['round_paired_ratio']['median']:.3f}"
        )
    return out


def render(ds: dict[str, Any], ctx: RenderContext) -> str:
    sd = ds["steady"]
    lines = [f"### DeepSpeed {ds['deepspeed']}, 2 processes on CPU (gloo): {ds['model']}", ""]
    lines.append(
        f"Steady: {sd['how']} ({sd['reps']} repetitions x {sd['rounds_per_rep']} rounds x {sd['round_steps']}"
        f" steps). Raw: {sd['raw']}. Ours: {sd['ours']}. Both engines get the same config (the job checks it)."
    )
    lines.append("")
    rows = []
    for key, st in ds["stages"].items():
        rows.append(
            [
                f"`{st['strategy']}`",
                str(st["threads_per_process"]),
                stat(st["variants"][RAW]["steady_steps_per_s"]),
                stat(st["variants"][OURS]["steady_steps_per_s"]),
                stat(ds["steady_ratios"][key][OURS]),
                stat(st.get("round_paired_ratio")),
                f"{st['setup_s'][RAW]:.2f} / {st['setup_s'][OURS]:.2f}",
            ]
        )
    header = ["strategy", "threads/proc", "raw steps/s", "ours steps/s", "ours ratio", "round-paired ratio"]
    lines += [*table([*header, "setup s raw / ours"], rows), ""]
    lines.append(
        "`ours ratio` (the target's) pairs each repetition's median rounds, as the DDP/FSDP sections do;"
        " `round-paired ratio` is a cross-check: per repetition, the median over rounds of the ratio within one"
        " round, less sensitive to load changes between rounds. Setup: the raw engine is built first, so its time"
        " includes `import deepspeed`."
    )
    return "\n".join(lines)


def _stage_target(stage: int) -> Target:
    return Target(
        f"deepspeed_stage_{stage}_steady",
        f"DeepSpeed ZeRO-{stage}, 2 procs: steady steps/s / raw DeepSpeed engine (same job, taking turns)",
        ("steady_ratios", f"stage_{stage}"),
        ">=",
        0.98,
    )


SECTION = Section(
    name="deepspeed",
    order=50,
    modes={
        "full": {"warmup": 10, "reps": 9, "rounds": 30, "round_steps": 3},
        "quick": {"warmup": 5, "reps": 3, "rounds": 10, "round_steps": 3},
        "tiny": {"warmup": 1, "reps": 1, "rounds": 1, "round_steps": 1},
    },
    run=run,
    render=render,
    unavailable=unavailable,
    compares_lightning=False,
    targets=tuple(_stage_target(stage) for stage in STAGES),
)
