"""2-rank FSDP sharded checkpoint: how long ``fabric.save`` blocks, synchronous vs ``async_save=True``.

One job (``fsdp_checkpoint_worker.py``, started with ``python`` so ``fabric.launch()`` starts the second rank)
alternates the two variants for ``ckpt_reps`` rounds on the same model; ratios are taken within a round.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks._common import REPO_ROOT, child_env, paired_ratios, parse_result, summarize

WORKER = str(REPO_ROOT / "benchmarks" / "fsdp_checkpoint_worker.py")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    size = int(cfg.get("fsdp_ckpt_mib", 128))
    reps = int(cfg.get("fsdp_ckpt_reps", 3))
    folder = tempfile.mkdtemp(prefix="fabric-bench-fsdp-ckpt-", dir=cfg.get("ckpt_dir") or None)
    env = child_env()
    for key in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        done = subprocess.run(
            [sys.executable, WORKER, str(size), str(reps), folder], capture_output=True, text=True, env=env, timeout=1800
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
            v: {"blocking_s": summarize(per[v]["blocking"]), "total_s": summarize(per[v]["total"])} for v in per
        },
        "ratios": {
            "async_blocking_vs_sync_blocking": paired_ratios(per["async"]["blocking"], per["sync"]["blocking"]),
            "async_total_vs_sync_total": paired_ratios(per["async"]["total"], per["sync"]["total"]),
        },
    }
