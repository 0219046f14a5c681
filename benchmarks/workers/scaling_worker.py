"""One N-process CPU (gloo) job of the ``scaling`` section: memory, checkpoint, first step and steady steps per rank.

    torchrun --standalone --nproc_per_node N benchmarks/workers/scaling_worker.py --impl raw --kind fsdp
    fabric run --accelerator cpu --devices N benchmarks/workers/scaling_worker.py --impl ours --kind fsdp

The model: ``--layers`` residual MLP blocks ``Linear(W, 4W) -> ReLU -> Linear(4W, W)``, AdamW (parameters,
gradients and two moments: 4 P bytes at N = 1). ``ddp``: replicated (raw ``DistributedDataParallel`` vs
``Fabric(strategy="ddp")``). ``fsdp``: FSDP2 ``fully_shard`` per block and at the root, built on the meta device and
materialised after sharding (raw: ``to_empty`` + ``reset_parameters``; ours: ``fabric.init_module(empty_init=True)``),
so no rank ever holds the whole model. ``model_parallel``: each block split column-then-row over a tensor-parallel
mesh of N ranks (``parallelize_module``; ours: ``ModelParallelStrategy(tensor_parallel_size=N)``), built whole on the
CPU first, as a user's script usually does. Every rank uses one thread and the same batch per rank.

Rank 0 prints one result line: the seconds from the job's start (``BENCH_T0``) to the end of the first optimizer
step, steady steps/s, each rank's resident memory (at the start, after setup, peak over the steps) and a sharded
checkpoint's save and load seconds (the slowest rank's, between barriers) and bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

T_PROCESS = time.time()
TIMES: dict[str, float] = {}

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when a launcher starts this file
from benchmarks._common import emit, peak_rss_kib, rss_kib  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(args.width) for _ in range(args.layers)))


def tp_plan(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _mp_parallelize(model: nn.Module, mesh) -> nn.Module:
    return tp_plan(model, mesh["tensor_parallel"])


# ------------------------------------------------------------------------------------------------ setups
def setup_raw(args: argparse.Namespace):
    # The modules the raw script uses, imported before its baseline as Fabric(...) imports ours before its own: they
    # are ~44 MiB of resident memory that is not the model's.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.barrier()
    TIMES["group_ready"] = time.time()
    base = rss_kib()
    if args.kind == "ddp":
        model = nn.parallel.DistributedDataParallel(build(args))
    elif args.kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        with torch.device("meta"):
            model = build(args)
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        model = tp_plan(build(args), init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return None, model, opt, base


def setup_ours(args: argparse.Namespace):
    from fabric_core import Fabric

    world = int(os.environ["WORLD_SIZE"])
    if args.kind == "ddp":
        strategy = "ddp"
    elif args.kind == "fsdp":
        from fabric_fsdp import FSDPStrategy

        strategy = FSDPStrategy(auto_wrap_policy={Block})
    else:
        from fabric_fsdp import ModelParallelStrategy

        strategy = ModelParallelStrategy(
            parallelize_fn=_mp_parallelize, data_parallel_size=1, tensor_parallel_size=world
        )
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=world)
    if not os.environ.get("FABRIC_CLI_USED"):  # under `fabric run`, Fabric(...) has joined the process group
        fabric.launch()
    dist.barrier()
    TIMES["group_ready"] = time.time()
    base = rss_kib()
    if args.kind == "fsdp":
        with fabric.init_module(empty_init=True):
            model = build(args)
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    elif args.kind == "model_parallel":
        model = fabric.setup_module(build(args))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        module = build(args)
        model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-4))
    return fabric, model, opt, base


# ------------------------------------------------------------------------------------------------ checkpoint
def _dir_bytes(path: str) -> tuple[int, int]:
    """Total bytes under ``path`` (a file or a folder) and the largest file's."""
    if os.path.isfile(path):
        size = os.path.getsize(path)
        return size, size
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs]
    return sum(sizes), max(sizes, default=0)


def checkpoint(args: argparse.Namespace, fabric, model, opt) -> dict:
    """Save, then load, the model and optimizer; seconds between barriers (every rank waits for the slowest)."""
    rank = dist.get_rank()
    path = os.path.join(args.ckpt_dir, f"scaling-{args.kind}-{args.impl}")
    if args.kind == "ddp":
        path += ".ckpt"
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
    dist.barrier()
    t0 = time.perf_counter()
    if fabric is not None:
        fabric.save(path, {"model": model, "optimizer": opt})
    elif args.kind == "ddp":
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
    dist.barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if fabric is not None:
        fabric.load(path, {"model": model, "optimizer": opt})
    elif args.kind == "ddp":
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    dist.barrier()
    load_s = time.perf_counter() - t0
    total, largest = _dir_bytes(path)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    return {"save_s": save_s, "load_s": load_s, "total_bytes": total, "largest_file_bytes": largest}


# ------------------------------------------------------------------------------------------------ collectives
def collectives(reps: int) -> dict[str, float]:
    """Median seconds of the collectives whose cost grows with the world (docs/scaling.md calibrates on them): the
    checkpoint vote (a 1-element all-reduce), ``broadcast_object`` of a path pair, ``all_gather_object`` of an error
    text (each 200 bytes), a barrier, and the creation of a gloo group (what ``checkpoint_coordinator`` makes once)."""
    import statistics

    from fabric_core.utilities.object_collectives import all_gather_object, broadcast_object

    text = "x" * 200
    ops = {
        "vote_all_reduce": lambda: dist.all_reduce(torch.ones(1, dtype=torch.long)),
        "broadcast_object": lambda: broadcast_object((text[:100], text[:100]) if dist.get_rank() == 0 else None),
        "all_gather_object": lambda: all_gather_object(text),
        "barrier": lambda: dist.barrier(),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    dist.barrier()
    t0 = time.perf_counter()
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    out["new_gloo_group"] = time.perf_counter() - t0
    dist.destroy_process_group(group)
    return out


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("raw", "ours"), required=True)
    p.add_argument("--kind", choices=("ddp", "fsdp", "model_parallel"), required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--collective-reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = float(os.environ.get("BENCH_T0", T_PROCESS))
    rss_start = rss_kib()
    fabric, model, opt, base = (setup_ours if args.impl == "ours" else setup_raw)(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_setup = rss_kib()
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))

    def step() -> float:
        loss = model(x).pow(2).mean()
        if fabric is not None:
            fabric.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())

    step()
    first_step_s = time.time() - t0
    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    dist.barrier()
    steady = args.steps / (time.perf_counter() - start)
    peak = peak_rss_kib()  # the high-water mark since the process started: setup, the first step and the steady ones
    ckpt = checkpoint(args, fabric, model, opt) if args.ckpt_dir else None
    coll = collectives(args.collective_reps) if args.collective_reps else None
    mine = {"rss_start_kib": rss_start, "rss_base_kib": base, "rss_setup_kib": rss_setup, "peak_kib": peak}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    n_params = sum(p.numel() for p in build_meta(args).parameters())
    if rank == 0:
        emit(
            {
                "world_size": world,
                "threads": torch.get_num_threads(),
                "first_step_s": first_step_s,
                "steady_steps_per_s": steady,
                "loss": loss,
                "parameters": n_params,
                "ranks": gathered,
                "checkpoint": ckpt,
                "collectives_s": coll,
                "group_ready_s": TIMES["group_ready"] - t0,
            }
        )
    dist.barrier()
    if fabric is None:
        dist.destroy_process_group()


def build_meta(args: argparse.Namespace) -> nn.Module:
    with torch.device("meta"):
        return build(args)


if __name__ == "__main__":
    main()
