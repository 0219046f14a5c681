"""2-process data parallel on CPU: steady steps/s and time to first step, ours vs a raw torchrun script.

Steady throughput: one torchrun job (``ddp_worker.py --impl interleaved``) holds a raw DDP (or FSDP2
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
import sys
import time
from typing import Any

from benchmarks._common import (
    LIGHTNING,
    OURS,
    RAW,
    REPO_ROOT,
    RESULT_PREFIX,
    child_env,
    module_available,
    paired_ratios,
    parse_result,
    rotated,
    summarize,
)

WORKER = str(REPO_ROOT / "benchmarks" / "ddp_worker.py")
PLUGIN_FOR = {"ddp": "fabric_ddp", "fsdp": "fabric_fsdp"}
_CLEAN_ENV = (
    "OMP_NUM_THREADS",
    "FABRIC_CLI_USED",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _job(variant: str, worker_args: list[str], timeout: float, worker: str = WORKER) -> dict[str, Any]:
    """Start one 2-process job of ``worker``; ``ours_launch`` without torchrun, everything else under it."""
    env = child_env()
    for key in _CLEAN_ENV:
        env.pop(key, None)
    if variant == "ours_launch":
        cmd = [sys.executable, worker, *worker_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            worker,
            *worker_args,
        ]
    env["BENCH_T0"] = repr(time.time())
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout)
    if proc.returncode != 0:
        if _EXIT_ABORT in proc.stderr and RESULT_PREFIX in proc.stdout:
            # The work finished and was reported; a rank then aborted at interpreter exit (the torch/gloo
            # teardown crash fabric-core guards against, docs/decisions.md): keep the numbers, count the crash.
            result = parse_result(proc.stdout)
            result["exit_aborted"] = True
            return result
        raise RuntimeError(f"{variant} job exited with {proc.returncode}:\n{proc.stderr[-2500:]}")
    return parse_result(proc.stdout)


#: What libstdc++ prints when a native thread is unwound during interpreter finalization (exit code 134/-6).
_EXIT_ABORT = "terminate called without an active exception"


def exit_aborts(samples: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Per variant, how many of its jobs reported their result and then crashed at exit."""
    return {v: sum(1 for r in rs if r.get("exit_aborted")) for v, rs in samples.items()}


def skip_reason(strategy: str) -> str | None:
    plugin = PLUGIN_FOR[strategy]
    if not module_available(plugin):
        return f"`{plugin}` is not importable: install {plugin.replace('_', '-')} (plugins/{strategy})"
    return None


def run(strategy: str, cfg: dict[str, Any], lightning: bool, log: Any = print) -> dict[str, Any]:
    reason = skip_reason(strategy)
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    with_lightning = lightning and strategy == "ddp"
    timeout = cfg.get("ddp_timeout", 600)

    # -------------------------------------------------------------- steady: one job, variants take turns
    steady_variants = [RAW, OURS] + ([LIGHTNING] if with_lightning else [])
    steady = _job(
        "interleaved",
        [
            "--impl", "interleaved", "--strategy", strategy, "--variants", ",".join(steady_variants),
            "--warmup", str(cfg["ddp_warmup"]), "--reps", str(cfg["ddp_steady_reps"]),
            "--rounds", str(cfg["ddp_rounds"]), "--round-steps", str(cfg["ddp_round_steps"]),
        ],
        timeout,
    )  # fmt: skip
    rates = steady["steps_per_s"]
    log(
        f"  {strategy} steady (interleaved): "
        + ", ".join(f"{v} {summarize(rates[v])['median']:.1f} it/s" for v in steady_variants)
    )

    # -------------------------------------------------------------- first step: fresh jobs
    first_variants = list(cfg.get("ddp_variants") or [RAW, OURS, "ours_launch", LIGHTNING])
    if not with_lightning:
        first_variants = [v for v in first_variants if v != LIGHTNING]
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in first_variants}
    reps = cfg["ddp_reps"]
    for rep in range(reps):
        for v in rotated(first_variants, rep):
            impl = OURS if v == "ours_launch" else v
            samples[v].append(
                _job(v, ["--impl", impl, "--strategy", strategy, "--warmup", "0", "--steps", "2"], timeout)
            )
        log(
            f"  {strategy} first step rep {rep + 1}/{reps}: "
            + ", ".join(f"{v} {samples[v][-1]['first_step_s']:.2f} s" for v in first_variants)
        )

    out: dict[str, Any] = {
        "status": "ok",
        "model": "3 x Linear(512,512) with ReLU, batch 64 per process, SGD, gloo",
        "steady": {
            "how": "one torchrun job, variants take turns in rounds; steps/s from each repetition's median round",
            "reps": cfg["ddp_steady_reps"],
            "rounds_per_rep": cfg["ddp_rounds"],
            "round_steps": cfg["ddp_round_steps"],
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
    }
    if any(out["jobs_aborted_at_exit"].values()):
        log(f"  {strategy} jobs that finished their work and then aborted at exit: {out['jobs_aborted_at_exit']}")
    for v in sorted(
        set(steady_variants) | set(first_variants), key=[RAW, OURS, "ours_launch", LIGHTNING].index
    ):
        entry: dict[str, Any] = {}
        if v in rates:
            entry["steady_steps_per_s"] = summarize(rates[v])
            if v != RAW:
                out["steady_ratios"][v] = paired_ratios(rates[v], rates[RAW])
        if v in samples:
            s = samples[v]
            entry["launch"] = (
                "python script.py + fabric.launch()" if v == "ours_launch" else "torchrun --nproc_per_node 2"
            )
            entry["threads_per_process"] = s[-1]["threads"]
            entry["first_step_s"] = summarize([r["first_step_s"] for r in s])
            entry["imported_s"] = summarize([r["imported_s"] for r in s])
            entry["setup_done_s"] = summarize([r["setup_s"] for r in s])
            if v != RAW:
                out["first_step_ratios"][v] = paired_ratios(
                    [r["first_step_s"] for r in s], [r["first_step_s"] for r in samples[RAW]]
                )
        out["variants"][v] = entry
    return out
