"""Steady steps/s of a raw DeepSpeed engine and of ``Fabric(strategy="deepspeed_stage_N")``, in one 2-process job.

    torchrun --standalone --nproc_per_node 2 benchmarks/workers/deepspeed_worker.py --stage 2

Both engines hold the same model (``ddp_worker.build_model``) with the same config and take turns in short rounds
(A B, B A, ...), so each pair of rounds sees the same machine; rank 0 prints one result line with each variant's
steps/s per repetition (from the median round). ZeRO's step ends in collectives, so rank 0's clock is the job's.

The raw engine is what a plain DeepSpeed script on the CPU does, and it is set up *first*, so it relies on nothing
Fabric prepared: ``DS_ACCELERATOR=cpu`` before ``import deepspeed``, a ``deepspeed.ops.__compatible_ops__`` table
that stops DeepSpeed JIT-compiling its shared-memory collectives op (``deepspeed_shm_comm``), and
``deepspeed.init_distributed("gloo")`` (which creates the process group from torchrun's variables). Its config is
written out below by hand; the job fails if it differs from the config the strategy built for its own engine.
Fabric then finds the group in place and joins it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when torchrun starts this file
from benchmarks._common import emit, rotated  # noqa: E402
from benchmarks.workers.ddp_worker import build_model  # noqa: E402

#: The raw engine's config: what `Fabric(strategy="deepspeed_stage_N")` gives DeepSpeed in float32 on the CPU
#: (the reference strategy's defaults, plus no clipping, one micro-batch, and every `step()` an optimizer step).
RAW_CONFIG = {
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": None,  # filled in from --stage
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 200_000_000,
        "reduce_bucket_size": 200_000_000,
        "sub_group_size": 1_000_000_000_000,
    },
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "single_submit": False,
        "overlap_events": True,
        "thread_count": 1,
    },
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "managed_gradient_accumulation": False,
    "gradient_clipping": 0.0,
}


def raw_engine(stage: int) -> tuple[object, dict]:
    """A plain DeepSpeed script's setup on the CPU (no Fabric involved)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}  # no JIT-compiled op on the CPU
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    config = copy.deepcopy(RAW_CONFIG)
    config["zero_optimization"]["stage"] = stage
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))
    return engine, config


def jit_ops_loaded() -> list[str]:
    """Modules loaded from torch's JIT-extension build folder (DeepSpeed's compiled ops): none, on the CPU."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.path.realpath(get_default_build_root())
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if os.path.realpath(getattr(module, "__file__", None) or "/").startswith(root + os.sep)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5, help="repetitions")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per repetition")
    parser.add_argument("--round-steps", type=int, default=3, help="steps per variant and round")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    t0 = time.perf_counter()
    engine, config = raw_engine(args.stage)
    t_raw = time.perf_counter()

    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu", strategy=f"deepspeed_stage_{args.stage}", devices=2)
    fabric.launch()
    model = build_model()
    ours_model, ours_optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    t_ours = time.perf_counter()
    if fabric.strategy.config != config:
        raise SystemExit(
            "the raw engine's config differs from the strategy's:\n"
            f"raw:  {json.dumps(config, sort_keys=True)}\nours: {json.dumps(fabric.strategy.config, sort_keys=True)}"
        )

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 512, generator=g), torch.randn(args.batch, 512, generator=g)

    def run_raw(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()  # steps, then zeroes the gradients
        return time.perf_counter() - t

    def run_ours(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            loss = F.mse_loss(ours_model(x), y)
            fabric.backward(loss)
            ours_optimizer.step()
            ours_optimizer.zero_grad()  # the ordinary Fabric loop (the engine's step zeroed them already)
        return time.perf_counter() - t

    runners = {"raw": run_raw, "ours": run_ours}
    variants = list(runners)
    for v in variants:
        runners[v](args.warmup)
    per_rep: dict[str, list[float]] = {v: [] for v in variants}
    # Per repetition: the median over rounds of raw's time / ours' time in the same round (ours' relative steps/s).
    round_ratios: list[float] = []
    for rep in range(args.reps):
        rounds: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in rotated(variants, rep * args.rounds + r):
                rounds[v].append(runners[v](args.round_steps))
        paired = sorted(a / b for a, b in zip(rounds["raw"], rounds["ours"]))
        round_ratios.append(paired[len(paired) // 2])
        for v in variants:
            rounds[v].sort()
            per_rep[v].append(args.round_steps / rounds[v][len(rounds[v]) // 2])
    if rank == 0:
        import deepspeed

        emit(
            {
                "steps_per_s": per_rep,
                "round_paired_ratios": round_ratios,
                "threads": torch.get_num_threads(),
                "world_size": world,
                "deepspeed": deepspeed.__version__,
                "config": config,
                "setup_s": {"raw": t_raw - t0, "ours": t_ours - t_raw},
                "jit_ops_loaded": jit_ops_loaded(),
            }
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
