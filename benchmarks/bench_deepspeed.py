"""DeepSpeed ZeRO stages 2 and 3, 2 processes on CPU (gloo): steady steps/s, ours vs a raw DeepSpeed engine.

One torchrun job per stage (``deepspeed_worker.py``) holds a raw ``deepspeed.initialize`` engine and the same model
set up through ``Fabric(strategy="deepspeed_stage_N")``, with the same config (the job checks it); they take turns
in short rounds, as in the DDP/FSDP sections. Ratios are paired within a repetition.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import OURS, RAW, REPO_ROOT, dist_version, module_available, paired_ratios, summarize
from benchmarks.bench_distributed import _job

WORKER = str(REPO_ROOT / "benchmarks" / "deepspeed_worker.py")
STAGES = (2, 3)


def skip_reason() -> str | None:
    if not module_available("fabric_deepspeed"):
        return "`fabric_deepspeed` is not importable: install fabric-deepspeed (plugins/deepspeed)"
    if not module_available("deepspeed"):
        return "`deepspeed` is not importable: install fabric-deepspeed (plugins/deepspeed), it depends on it"
    return None


def run(cfg: dict[str, Any], log: Any = print) -> dict[str, Any]:
    reason = skip_reason()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    timeout = cfg.get("ddp_timeout", 600)
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
            "reps": cfg["ds_reps"],
            "rounds_per_rep": cfg["ds_rounds"],
            "round_steps": cfg["ds_round_steps"],
        },
        "stages": {},
        "steady_ratios": {},
    }
    for stage in STAGES:
        res = _job(
            "interleaved",
            [
                "--stage", str(stage), "--warmup", str(cfg["ds_warmup"]), "--reps", str(cfg["ds_reps"]),
                "--rounds", str(cfg["ds_rounds"]), "--round-steps", str(cfg["ds_round_steps"]),
            ],
            timeout,
            worker=WORKER,
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
