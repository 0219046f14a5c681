"""One 2-process tensor parallel x FSDP2 training run on CPU (gloo), written raw or through a Fabric; used by
sections/model_parallel.py (through sections/_data_parallel.py, with the command line and result of ddp_worker.py).

    torchrun --standalone --nproc_per_node 2 benchmarks/workers/model_parallel_worker.py --impl raw
    torchrun --standalone --nproc_per_node 2 benchmarks/workers/model_parallel_worker.py --impl ours
    python benchmarks/workers/model_parallel_worker.py --impl ours          # fabric.launch() starts rank 1
    torchrun ... benchmarks/workers/model_parallel_worker.py --impl lightning   # lightning-fabric's strategy
    torchrun ... benchmarks/workers/model_parallel_worker.py --impl interleaved --variants raw,ours,lightning

The same model, data, optimizer and seeds in both: two residual MLP blocks, each split column-then-row over the
``tensor_parallel`` dimension of a ``(data_parallel=1, tensor_parallel=2)`` device mesh with ``parallelize_module``,
then ``fully_shard`` over ``data_parallel``; AdamW; the same batch on both ranks (tensor-parallel peers read the same
data). Raw: ``init_process_group("gloo")``, ``init_device_mesh`` and the plan by hand. Ours: ``Fabric(strategy=
ModelParallelStrategy(parallelize_fn=..., data_parallel_size=1, tensor_parallel_size=2))``, ``setup_module`` and
``setup_optimizers``, the ordinary Fabric loop. Lightning: the same through lightning-fabric's
``ModelParallelStrategy`` (it runs on CPU). Rank 0 prints one result line (see ddp_worker.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_PROCESS = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when torchrun starts this file
from benchmarks._common import emit, emit_training, rotated, timed_training, train_step  # noqa: E402
from benchmarks.workers.blocks import Block  # noqa: E402

WIDTH, HIDDEN = 512, 1024
MESH_SHAPE = (1, 2)  # (data_parallel, tensor_parallel)
MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(WIDTH, HIDDEN), Block(WIDTH, HIDDEN))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Each block's MLP split over ``tensor_parallel`` (column then row), then FSDP2 over ``data_parallel``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model:
        parallelize_module(
            block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def raw_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The raw script's setup, over the default process group: the 2-D mesh and the plan by hand."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMENSIONS)
    model = parallelize(build_model(), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def ours_fabric(impl: str = "ours"):
    """``Fabric(strategy=ModelParallelStrategy(...))``, launched: ours, or lightning-fabric's (same arguments)."""
    if impl == "lightning":
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import ModelParallelStrategy
    else:
        from fabric_core import Fabric
        from fabric_fsdp import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=MESH_SHAPE[0], tensor_parallel_size=MESH_SHAPE[1]
    )
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    return fabric


def ours_model(fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fabric.setup_module(build_model())
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))


def batch(size: int) -> torch.Tensor:
    return torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(0))  # the same on both ranks


def interleaved(args: argparse.Namespace) -> None:
    """Steady throughput of every variant inside one job, taking turns in short rounds (A B C, B C A, ...).

    Ours starts the job (it initialises the process group, as a user's script does); the raw loop and
    lightning-fabric build their own meshes over that group.
    """
    variants = args.variants.split(",")
    unknown = set(variants) - {"raw", "ours", "lightning"}
    if unknown:
        raise SystemExit(f"model_parallel_worker: unknown variants {sorted(unknown)} (raw, ours, lightning)")
    fabric = ours_fabric()
    rank, world = fabric.global_rank, fabric.world_size
    runners: dict[str, tuple] = {}
    for v in variants:
        if v == "raw":
            runners[v] = (None, *raw_model())
        else:
            owner = fabric if v == "ours" else ours_fabric(v)  # lightning-fabric joins the same process group
            runners[v] = (owner, *ours_model(owner))
    x = batch(args.batch)

    def run(v: str, n: int) -> tuple[float, float]:
        """``n`` steps of ``v``: (wall seconds, this process's CPU seconds)."""
        owner, model, optimizer = runners[v]
        t, c = time.perf_counter(), time.process_time()
        for _ in range(n):
            train_step(model, optimizer, x, x, owner)
        return time.perf_counter() - t, time.process_time() - c

    for v in variants:
        run(v, args.warmup)
    per_rep: dict[str, list[float]] = {v: [] for v in variants}
    # The same from the process's CPU time (gloo waits for its peer without spinning): what the steps cost this
    # process, leaving out the moments another process of a shared machine held the core; a cross-check.
    cpu_per_rep: dict[str, list[float]] = {v: [] for v in variants}
    # Per repetition and variant: the median over rounds of raw's time / the variant's in the same round (its
    # relative steps/s), a cross-check less sensitive to load changes between rounds than the median rounds' ratio.
    round_paired: dict[str, list[float]] = {v: [] for v in variants if v != "raw"}
    for rep in range(args.reps):
        rounds: dict[str, list[float]] = {v: [] for v in variants}
        cpu_rounds: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in rotated(variants, rep * args.rounds + r):
                wall, cpu = run(v, args.round_steps)
                rounds[v].append(wall)
                cpu_rounds[v].append(cpu)
        for v in round_paired:
            paired = sorted(a / b for a, b in zip(rounds["raw"], rounds[v]))
            round_paired[v].append(paired[len(paired) // 2])
        for v in variants:
            rounds[v].sort()
            per_rep[v].append(args.round_steps / rounds[v][len(rounds[v]) // 2])
            cpu_rounds[v].sort()
            cpu_per_rep[v].append(args.round_steps / cpu_rounds[v][len(cpu_rounds[v]) // 2])
    # Every variant took the same steps from the same weights and data: their losses now agree (a check that
    # both train the same thing, shown beside the numbers).
    with torch.no_grad():
        losses = {v: float(F.mse_loss(runners[v][1](x), x)) for v in variants}
    if rank == 0:
        emit(
            {
                "steps_per_s": per_rep,
                "round_paired_ratios": round_paired,
                "cpu_steps_per_s": cpu_per_rep,
                "threads": torch.get_num_threads(),
                "world_size": world,
                "final_loss": losses,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("raw", "ours", "lightning", "interleaved"), required=True)
    parser.add_argument("--strategy", choices=("model_parallel",), default="model_parallel")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--variants", default="raw,ours", help="interleaved: which variants take turns")
    parser.add_argument("--reps", type=int, default=5, help="interleaved: repetitions")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved: rounds per repetition")
    parser.add_argument("--round-steps", type=int, default=3, help="interleaved: steps per variant and round")
    args = parser.parse_args()
    if args.impl == "interleaved":
        interleaved(args)
        return
    t0 = float(os.environ.get("BENCH_T0", T_PROCESS))
    t_imported = time.time()

    fabric = None
    if args.impl == "raw":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model, optimizer = raw_model()
    else:
        fabric = ours_fabric(args.impl)
        rank, world = fabric.global_rank, fabric.world_size
        model, optimizer = ours_model(fabric)
    t_setup = time.time()

    x = batch(args.batch)
    timed = timed_training(model, optimizer, x, x, fabric, args.warmup, args.steps)
    if rank == 0:
        emit_training(args, world, t0, t_imported, t_setup, timed)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
