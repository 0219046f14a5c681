"""2-process data or model parallel on CPU: steady steps/s and time to first step, ours vs a raw torchrun script.

The measurement and the rendering of the ``ddp``, ``fsdp`` and ``model_parallel`` sections (``ddp.py``, ``fsdp.py``,
``model_parallel.py`` declare them; ``model_parallel`` uses ``workers/model_parallel_worker.py``, which takes the
same command line and prints the same result as ``workers/ddp_worker.py``).
Steady throughput: one torchrun job (``workers/ddp_worker.py --impl interleaved``) holds a raw DDP (or FSDP2
``fully_shard``) model, the same model set up through ``Fabric(strategy=...)`` and, for DDP, through
lightning-fabric; they take turns in short rounds, so each pair of rounds sees the same machine. Time to first
step: fresh jobs, one per variant, interleaved and rotated per repetition. ``raw`` is the plain script under
torchrun; ``ours`` is the Fabric script under the same torchrun; ``ours_launch`` starts with ``python
script.py`` and lets ``fabric.launch()`` start the second process (what most users do); ``lightning`` is
lightning-fabric under torchrun (DDP only: it refuses FSDP on CPU).

``OMP_NUM_THREADS`` is removed from the environment, so each launcher applies its own default (torchrun: 1
thread per process; ours: cores // processes); the thread count each run used is recorded.
"""

from __future__ import annotations

import subprocess
from typing import Any

from benchmarks._common import (
    LIGHTNING,
    OURS,
    RAW,
    REPO_ROOT,
    exit_aborts,
    module_available,
    paired_ratios,
    rotated,
    run_job,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RunContext, Target

WORKERS = REPO_ROOT / "benchmarks" / "workers"
#: The worker script of each strategy (one command line and result format for all).
WORKER_FOR = {
    "ddp": str(WORKERS / "ddp_worker.py"),
    "fsdp": str(WORKERS / "ddp_worker.py"),
    "model_parallel": str(WORKERS / "model_parallel_worker.py"),
}
PLUGIN_FOR = {"ddp": "fabric_ddp", "fsdp": "fabric_fsdp", "model_parallel": "fabric_fsdp"}
MODEL_FOR = {
    "ddp": "3 x Linear(512,512) with ReLU, batch 64 per process, SGD, gloo",
    "fsdp": "3 x Linear(512,512) with ReLU, batch 64 per process, SGD, gloo",
    "model_parallel": (
        "2 residual blocks of Linear(512,1024)-ReLU-Linear(1024,512), each split column-then-row over"
        " `tensor_parallel` with `parallelize_module`, then `fully_shard` over `data_parallel`, mesh (1, 2);"
        " batch 32 (the same on both ranks), AdamW, gloo"
    ),
}


def _job(strategy: str, variant: str, args: list[str], timeout: float) -> dict[str, Any]:
    """``ours_launch`` starts with ``python script.py`` (``fabric.launch()`` starts rank 1), the rest under torchrun."""
    return run_job(WORKER_FOR[strategy], args, torchrun=variant != "ours_launch", timeout=timeout)


def unavailable(strategy: str) -> str | None:
    plugin = PLUGIN_FOR[strategy]
    if not module_available(plugin):
        return f"`{plugin}` is not importable: install {plugin.replace('_', '-')} (plugins/{strategy})"
    return None


def run(strategy: str, ctx: RunContext) -> dict[str, Any]:
    cfg, log = ctx.config, ctx.log
    with_lightning = ctx.lightning  # the fsdp section leaves it out: lightning-fabric refuses FSDP on CPU
    timeout = cfg.get("timeout", 600)

    # -------------------------------------------------------------- steady: one job, variants take turns
    steady_variants = [RAW, OURS] + ([LIGHTNING] if with_lightning else [])
    steady = _job(
        strategy,
        "interleaved",
        [
            "--impl", "interleaved", "--strategy", strategy, "--variants", ",".join(steady_variants),
            "--warmup", str(cfg["warmup"]), "--reps", str(cfg["steady_reps"]),
            "--rounds", str(cfg["rounds"]), "--round-steps", str(cfg["round_steps"]),
        ],
        timeout,
    )  # fmt: skip
    rates = steady["steps_per_s"]
    log(
        f"  {strategy} steady (interleaved): "
        + ", ".join(f"{v} {summarize(rates[v])['median']:.1f} it/s" for v in steady_variants)
    )

    # -------------------------------------------------------------- first step: fresh jobs
    first_variants = list(cfg.get("first_step_variants") or [RAW, OURS, "ours_launch", LIGHTNING])
    if not with_lightning:
        first_variants = [v for v in first_variants if v != LIGHTNING]
    # One entry per repetition; None where the job failed or hung (recorded, and left out of the pairs).
    samples: dict[str, list[dict[str, Any] | None]] = {v: [] for v in first_variants}
    failed: list[str] = []
    reps = cfg["first_step_reps"]
    for rep in range(reps):
        for v in rotated(first_variants, rep):
            impl = OURS if v == "ours_launch" else v
            try:
                res = _job(
                    strategy,
                    v,
                    ["--impl", impl, "--strategy", strategy, "--warmup", "0", "--steps", "2"],
                    timeout,
                )
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                res = None
                failed.append(f"repetition {rep + 1}, {v}: {type(err).__name__}: {str(err)[-600:]}")
            samples[v].append(res)
        log(
            f"  {strategy} first step rep {rep + 1}/{reps}: "
            + ", ".join(
                f"{v} {r['first_step_s']:.2f} s" if (r := samples[v][-1]) else f"{v} failed"
                for v in first_variants
            )
        )

    out: dict[str, Any] = {
        "status": "ok",
        "model": MODEL_FOR[strategy],
        "steady": {
            "how": "one torchrun job, variants take turns in rounds; steps/s from each repetition's median round",
            "reps": cfg["steady_reps"],
            "rounds_per_rep": cfg["rounds"],
            "round_steps": cfg["round_steps"],
            "threads_per_process": steady["threads"],
        },
        "first_step": {
            "how": "fresh job per variant and repetition, from job start to the end of the first optimizer step",
            "reps": reps,
        },
        "variants": {},
        "steady_ratios": {},
        "first_step_ratios": {},
        "jobs_aborted_at_exit": exit_aborts(samples | {"interleaved": [steady]}),
        "failed_jobs": failed,
    }
    if "round_paired_ratios" in steady:  # model_parallel's worker: a cross-check of the steady ratio
        out["steady_round_paired_ratios"] = {
            v: summarize(r) for v, r in steady["round_paired_ratios"].items()
        }
    if (
        "cpu_steps_per_s" in steady
    ):  # model_parallel's worker: steps per CPU second of rank 0, paired as above
        out["steady_cpu_ratios"] = {
            v: paired_ratios(r, steady["cpu_steps_per_s"][RAW])
            for v, r in steady["cpu_steps_per_s"].items()
            if v != RAW
        }
    if "final_loss" in steady:  # the variants trained the same model on the same data: their losses agree
        out["steady"]["final_loss"] = steady["final_loss"]
    if any(out["jobs_aborted_at_exit"].values()):
        log(
            f"  {strategy} jobs that finished their work and then aborted at exit: {out['jobs_aborted_at_exit']}"
        )
    for v in sorted(
        set(steady_variants) | set(first_variants), key=[RAW, OURS, "ours_launch", LIGHTNING].index
    ):
        entry: dict[str, Any] = {}
        if v in rates:
            entry["steady_steps_per_s"] = summarize(rates[v])
            if v != RAW:
                out["steady_ratios"][v] = paired_ratios(rates[v], rates[RAW])
        if v in samples:
            s = [r for r in samples[v] if r is not None]
            entry["launch"] = (
                "python script.py + fabric.launch()" if v == "ours_launch" else "torchrun --nproc_per_node 2"
            )
            entry["threads_per_process"] = s[-1]["threads"] if s else None
            entry["first_step_s"] = summarize([r["first_step_s"] for r in s])
            entry["imported_s"] = summarize([r["imported_s"] for r in s])
            entry["setup_done_s"] = summarize([r["setup_s"] for r in s])
            if v != RAW:  # pairs of the repetitions in which both jobs finished
                pairs = [(a, b) for a, b in zip(samples[v], samples[RAW]) if a is not None and b is not None]
                out["first_step_ratios"][v] = paired_ratios(
                    [a["first_step_s"] for a, _ in pairs], [b["first_step_s"] for _, b in pairs]
                )
        out["variants"][v] = entry
    return out


def render(title: str, d: dict[str, Any]) -> str:
    sd, fs = d["steady"], d["first_step"]
    lines = [f"### {title}, 2 processes on CPU (gloo): {d['model']}", ""]
    lines.append(
        f"Steady: {sd['how']} ({sd['reps']} repetitions x {sd['rounds_per_rep']} rounds x {sd['round_steps']} steps,"
        f" {sd['threads_per_process']} thread(s) per process). First step: {fs['how']} ({fs['reps']} repetitions)."
    )
    round_paired = d.get("steady_round_paired_ratios")
    if round_paired:
        lines.append("")
        lines.append(
            "Round-paired steady ratio (per repetition, the median over rounds of the ratio within one round; a"
            " cross-check less sensitive to load changes between rounds): "
            + ", ".join(f"{v} {stat(r)}" for v, r in round_paired.items())
            + "."
        )
    cpu = d.get("steady_cpu_ratios")
    if cpu:
        lines.append("")
        lines.append(
            "Steady ratio from rank 0's CPU time instead of the wall clock (gloo waits for the peer without"
            " spinning, so this leaves out the moments another process held the core; a cross-check): "
            + ", ".join(f"{v} {stat(r)}" for v, r in cpu.items())
            + "."
        )
    losses = sd.get("final_loss")
    if losses:
        lines.append("")
        lines.append(
            "Loss after the steady job (every variant took the same steps from the same weights and data): "
            + ", ".join(f"{v} {loss:.6g}" for v, loss in losses.items())
            + "."
        )
    lines.append("")
    rows = []
    for v, e in d["variants"].items():
        rows.append(
            [
                v,
                e.get("launch", "–"),
                str(e.get("threads_per_process", "–")),
                stat(e.get("steady_steps_per_s")),
                ("1" if v == RAW else stat(d["steady_ratios"].get(v))) if "steady_steps_per_s" in e else "–",
                stat(e.get("first_step_s")),
                ("1" if v == RAW else stat(d["first_step_ratios"].get(v))) if "first_step_s" in e else "–",
                stat(e.get("imported_s")),
                stat(e.get("setup_done_s")),
            ]
        )
    header = ["variant", "launch (first-step jobs)", "threads/proc", "steady steps/s", "steady ratio"]
    header += ["first step s", "first-step ratio", "imports done s", "setup done s"]
    lines += table(header, rows)
    aborted = {k: n for k, n in d.get("jobs_aborted_at_exit", {}).items() if n}
    if aborted:
        lines += ["", f"Jobs that reported their numbers and then aborted at interpreter exit: {aborted}."]
    if d.get("failed_jobs"):
        lines += ["", "First-step jobs that failed or hung (left out of the pairs):", ""]
        lines += [f"- {f.splitlines()[0][:300]}" for f in d["failed_jobs"]]
    return "\n".join(lines)


def steady_target(strategy: str, title: str, raw: str | None = None, bound: float = 0.99) -> Target:
    """The steady steps/s target of a section: ours over ``raw`` (by default, raw ``title``) in the same job."""
    raw = raw or f"raw {title}{'2' if strategy == 'fsdp' else ''}"
    return Target(
        f"{strategy}_steady",
        f"{title} 2 procs: steady steps/s / {raw} (same job, taking turns)",
        ("steady_ratios",),
        ">=",
        bound,
    )
