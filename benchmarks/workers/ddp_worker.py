"""One 2-process data-parallel training run on CPU (gloo), written raw or through a Fabric; used by sections/ddp.py and fsdp.py.

    torchrun --standalone --nproc_per_node 2 benchmarks/workers/ddp_worker.py --impl raw --strategy ddp
    torchrun --standalone --nproc_per_node 2 benchmarks/workers/ddp_worker.py --impl ours --strategy ddp
    python benchmarks/workers/ddp_worker.py --impl ours --strategy ddp          # fabric.launch() starts rank 1
    torchrun ... benchmarks/workers/ddp_worker.py --impl interleaved --variants raw,ours,lightning

Rank 0 prints one result line: seconds from ``BENCH_T0`` (set by the harness just before it starts the job) to
the end of the first optimizer step, with the moments imports and setup finished, and the steady steps/s (from
the median step time of the measured steps after warm-up; the mean is reported too). DDP averages gradients in
every backward, so rank 0's clock is the job's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_PROCESS = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when torchrun starts this file
from benchmarks._common import emit, emit_training, rotated, timed_training, train_step  # noqa: E402


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def interleaved(args: argparse.Namespace) -> None:
    """Steady throughput of every variant inside one job, taking turns in short rounds (A B C, B C A, ...).

    Separate jobs land on a shared machine in different moments; here each pair of rounds sees the same one,
    so the ratio is far less noisy. Ours starts the job (it initialises the process group, as in a user's
    script); the raw model and lightning-fabric then use that same default group.
    """
    from fabric_core import Fabric

    variants = args.variants.split(",")
    ours = Fabric(accelerator="cpu", strategy=args.strategy, devices=2)
    ours.launch()
    rank, world = ours.global_rank, ours.world_size
    runners: dict[str, tuple] = {}
    for v in variants:
        model = build_model()
        if v == "raw":
            if args.strategy == "ddp":
                model = nn.parallel.DistributedDataParallel(model)
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            runners[v] = (None, model, torch.optim.SGD(model.parameters(), lr=1e-3))
        else:
            fabric = ours
            if v == "lightning":
                from lightning_fabric import Fabric as LightningFabric

                fabric = LightningFabric(accelerator="cpu", strategy=args.strategy, devices=2)
                fabric.launch()
            runners[v] = (fabric, *fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3)))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 512, generator=g), torch.randn(args.batch, 512, generator=g)

    def run(v: str, n: int) -> float:
        fabric, model, optimizer = runners[v]
        t = time.perf_counter()
        for _ in range(n):
            train_step(model, optimizer, x, y, fabric)
        return time.perf_counter() - t

    for v in variants:
        run(v, args.warmup)
    per_rep: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps):
        rounds: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in rotated(variants, rep * args.rounds + r):
                rounds[v].append(run(v, args.round_steps))
        for v in variants:
            rounds[v].sort()
            per_rep[v].append(args.round_steps / rounds[v][len(rounds[v]) // 2])
    if rank == 0:
        emit({"steps_per_s": per_rep, "threads": torch.get_num_threads(), "world_size": world})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("raw", "ours", "lightning", "interleaved"), required=True)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
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
        model = build_model()
        if args.strategy == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        if args.impl == "ours":
            from fabric_core import Fabric
        else:
            from lightning_fabric import Fabric
        fabric = Fabric(accelerator="cpu", strategy=args.strategy, devices=2)
        fabric.launch()
        rank, world = fabric.global_rank, fabric.world_size
        model = build_model()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    t_setup = time.time()

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 512, generator=g), torch.randn(args.batch, 512, generator=g)
    timed = timed_training(model, optimizer, x, y, fabric, args.warmup, args.steps)
    if rank == 0:
        emit_training(args, world, t0, t_imported, t_setup, timed)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
