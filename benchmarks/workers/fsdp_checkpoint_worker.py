"""2-rank FSDP sharded saves, synchronous and asynchronous, taking turns; run by ``sections/fsdp_checkpoint.py``.

    python benchmarks/workers/fsdp_checkpoint_worker.py SIZE_MIB REPS FOLDER

Rank 0 prints one result line: per variant, the seconds ``fabric.save`` blocked the loop and the seconds until
the checkpoint was committed (``handle.wait()``), for each repetition.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks._common import emit
from fabric_core import Fabric


def main(size_mib: int, reps: int, folder: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    width = 1024
    layers = max(1, size_mib * 2**20 // (4 * width * width))
    model = fabric.setup_module(
        torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    )
    state = {"model": model, "step": 0}
    # the first asynchronous save sets up its buffers and group
    fabric.save(f"{folder}/warmup", state, async_save=True).wait()
    results: dict[str, dict[str, list[float]]] = {v: {"blocking": [], "total": []} for v in ("sync", "async")}
    for rep in range(reps):
        for variant in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
            fabric.barrier()
            t0 = time.perf_counter()
            handle = fabric.save(f"{folder}/{variant}", state, async_save=variant == "async")
            blocking = time.perf_counter() - t0
            handle.wait()
            fabric.barrier()
            results[variant]["blocking"].append(blocking)
            results[variant]["total"].append(time.perf_counter() - t0)
    if fabric.is_global_zero:
        params = sum(p.numel() * p.element_size() for p in model.parameters()) * fabric.world_size
        emit({"status": "ok", "state_mib": params / 2**20, "reps": reps, "per_rep": results})
    json.dumps(results)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
