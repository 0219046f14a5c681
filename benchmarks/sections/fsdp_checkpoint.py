"""2-rank FSDP sharded checkpoint: how long ``fabric.save`` blocks, synchronous vs ``async_save=True``.

One job (``workers/fsdp_checkpoint_worker.py``, started with ``python`` so ``fabric.launch()`` starts the second
rank) alternates the two variants for ``reps`` rounds on the same model; ratios are taken within a round.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks._common import REPO_ROOT, child_env, module_available, paired_ratios, parse_result, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section

WORKER = str(REPO_ROOT / "benchmarks" / "workers" / "fsdp_checkpoint_worker.py")


def run(ctx: RunContext) -> dict[str, Any]:
    size, reps = int(ctx.config["state_mib"]), int(ctx.config["reps"])
    folder = tempfile.mkdtemp(prefix="fabric-bench-fsdp-ckpt-", dir=ctx.options.get("ckpt_dir") or None)
    env = child_env()
    for key in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        done = subprocess.run(
            [sys.executable, WORKER, str(size), str(reps), folder],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if done.returncode != 0:
            return {"status": "error", "reason": (done.stdout + done.stderr)[-3000:]}
        raw = parse_result(done.stdout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per = raw["per_rep"]
    return {
        "status": "ok",
        "state_mib": raw["state_mib"],
        "reps": reps,
        "variants": {
            v: {"blocking_s": summarize(per[v]["blocking"]), "total_s": summarize(per[v]["total"])}
            for v in per
        },
        "ratios": {
            "async_blocking_vs_sync_blocking": paired_ratios(
                per["async"]["blocking"], per["sync"]["blocking"]
            ),
            "async_total_vs_sync_total": paired_ratios(per["async"]["total"], per["sync"]["total"]),
        },
    }


def render(fc: dict[str, Any], ctx: RenderContext) -> str:
    rows = [[v, stat(e["blocking_s"]), stat(e["total_s"])] for v, e in fc["variants"].items()]
    return "\n".join(
        [
            f"### FSDP 2 procs: sharded save of {fc['state_mib']:.0f} MiB, {fc['reps']} repetition(s), sync vs async",
            "",
            *table(["fabric.save", "blocking s", "until committed s"], rows),
            "",
            f"async / sync blocking: {stat(fc['ratios']['async_blocking_vs_sync_blocking'])}; async / sync until"
            f" committed: {stat(fc['ratios']['async_total_vs_sync_total'])}. The asynchronous save copies the shards"
            " into CPU buffers torch.distributed.checkpoint's stager keeps for the next save, then writes and commits"
            " in the background over its own gloo group.",
        ]
    )


SECTION = Section(
    name="fsdp_checkpoint",
    order=70,
    modes={
        "full": {"state_mib": 256, "reps": 4},
        "quick": "not run in --quick mode (run `python -m benchmarks` for it)",
        "tiny": {"state_mib": 8, "reps": 1},
    },
    run=run,
    render=render,
    unavailable=lambda: (
        None
        if module_available("fabric_fsdp")
        else "`fabric_fsdp` is not importable: install fabric-fsdp (plugins/fsdp)"
    ),
    compares_lightning=False,
)
