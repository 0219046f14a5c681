"""2-process pipeline parallelism on CPU (gloo), raw ``torch.distributed.pipelining`` vs ``fabric.forward_backward``
on ``ModelParallelStrategy(pipeline_parallel_size=2)``; and the memory per rank of each parallel axis. Used by
sections/pipeline.py.

    torchrun --standalone --nproc_per_node 2 benchmarks/workers/pipeline_worker.py steady --schedules GPipe,1F1B
    torchrun --standalone --nproc_per_node 2 benchmarks/workers/pipeline_worker.py memory --layout pp2
    python benchmarks/workers/pipeline_worker.py memory --layout single

``steady``: one job in which, per schedule, the raw loop and ours take turns in rounds (same model, weights, data,
AdamW). Raw: ``PipelineStage`` over the hand-cut halves (or quarters, for the interleaved schedule) of an
``nn.Sequential`` and the schedule class, rank 0 ``step(x)``, the last stage ``step(target=y, losses=...)``, then
``optimizer.step()``. Ours: ``loss = fabric.forward_backward(model, x, target=y, loss_fn=...)`` (every rank passes the
batch, every rank gets the loss) and ``optimizer.step()``. The raw rounds also time each stage's compute (its
``forward_one_chunk``/``backward_one_chunk``): the bubble is the share of the step a rank spends outside them.

``memory``: one layout of a small transformer (1 process; data parallel 2 with FSDP2; tensor parallel 2 of the MLPs;
pipeline 2; sequence parallel 2 with FSDP2 over data x sequence), one AdamW step; per rank the bytes of its
parameters and optimizer state (what stays between steps), of its gradients, and the resident memory a step adds
(peak RSS during the second step above the RSS before it, ``/proc/self/clear_refs``: activations, gradients and
transfer buffers; the section sets ``MALLOC_MMAP_THRESHOLD_`` so freed blocks go back to the system). Rank 0 prints one
result line (``benchmarks._common.emit``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository root, for `benchmarks` when torchrun starts this file
from benchmarks._common import emit, peak_rss_kib, reset_peak_rss, rotated, rss_kib  # noqa: E402
from benchmarks.workers.blocks import Block  # noqa: E402

WIDTH, HIDDEN, BLOCKS = 256, 1024, 8


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH, HIDDEN, torch.tanh) for _ in range(BLOCKS)])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def theoretical_bubble(schedule: str, stages: int, micro_batches: int, per_rank: int) -> float:
    """The share of a step each rank idles in the schedule's ideal timeline (equal stage times, free transfers):
    ``(p - 1) / (v m + p - 1)`` for ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank (1 but interleaved)."""
    p = stages // per_rank
    return (p - 1) / (per_rank * micro_batches + p - 1)


class Raw:
    """The raw loop: stages and schedule by hand over the world group."""

    def __init__(self, schedule: str, micro_batches: int, per_rank: int) -> None:
        from torch.distributed import pipelining

        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = build()
        stages = world * per_rank
        size = BLOCKS // stages
        indices = [rank + k * world for k in range(per_rank)]
        self.stages = [
            pipelining.PipelineStage(self.model[i * size : (i + 1) * size], i, stages, torch.device("cpu"))
            for i in indices
        ]
        cls = pipelining.schedules.get_schedule_class(schedule)
        target = self.stages if per_rank > 1 else self.stages[0]
        self.schedule = cls(target, n_microbatches=micro_batches, loss_fn=loss_fn)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.first, self.last = 0 in indices, stages - 1 in indices
        self.busy = 0.0
        for stage in self.stages:  # the compute of each micro-batch, timed (for the bubble)
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t

        return timed

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        losses: list = []
        if self.first:
            self.schedule.step(x, target=y if self.last else None, losses=losses if self.last else None)
        else:
            self.schedule.step(target=y if self.last else None, losses=losses if self.last else None)
        self.optimizer.step()
        self.optimizer.zero_grad()


class Ours:
    """The same through Fabric: ``forward_backward`` then ``optimizer.step()``."""

    def __init__(self, schedule: str, micro_batches: int, per_rank: int) -> None:
        from fabric_core import Fabric
        from fabric_fsdp import ModelParallelStrategy

        stages = dist.get_world_size() * per_rank
        split = [str(i * BLOCKS // stages) for i in range(1, stages)]
        strategy = ModelParallelStrategy(
            pipeline_parallel_size=dist.get_world_size(),
            pipeline_split=split,
            pipeline_schedule=schedule,
            pipeline_micro_batches=micro_batches,
        )
        self.fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        self.fabric.launch()
        model = build()
        self.model, self.optimizer = self.fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.fabric.forward_backward(self.model, x, target=y, loss_fn=loss_fn)
        self.optimizer.step()
        self.optimizer.zero_grad()


def steady(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, WIDTH, generator=g), torch.randn(args.batch, WIDTH, generator=g)
    result: dict = {"threads": torch.get_num_threads(), "schedules": {}}
    for schedule in args.schedules.split(","):
        per_rank = 2 if schedule.startswith("Interleaved") else 1
        runners = {"raw": Raw(schedule, args.micro_batches, per_rank), "ours": Ours(schedule, args.micro_batches, per_rank)}

        def run(v: str, n: int, runners: dict = runners) -> float:
            t = time.perf_counter()
            for _ in range(n):
                runners[v].step(x, y)
            return time.perf_counter() - t

        for v in runners:
            run(v, args.warmup)
        rates: dict[str, list[float]] = {v: [] for v in runners}
        bubbles: list[float] = []
        for rep in range(args.reps):
            rounds: dict[str, list[float]] = {v: [] for v in runners}
            raw_bubble: list[float] = []
            for r in range(args.rounds):
                for v in rotated(list(runners), rep * args.rounds + r):
                    busy = runners["raw"].busy
                    wall = run(v, args.round_steps)
                    rounds[v].append(wall)
                    if v == "raw":
                        raw_bubble.append(1.0 - (runners["raw"].busy - busy) / wall)
            for v in runners:
                rounds[v].sort()
                rates[v].append(args.round_steps / rounds[v][len(rounds[v]) // 2])
            raw_bubble.sort()
            bubbles.append(raw_bubble[len(raw_bubble) // 2])
        every = [torch.zeros(args.reps) for _ in range(dist.get_world_size())]
        dist.all_gather(every, torch.tensor(bubbles))
        result["schedules"][schedule] = {
            "steps_per_s": rates,
            "bubble_per_rank": [t.tolist() for t in every],
            "theoretical_bubble": theoretical_bubble(schedule, dist.get_world_size() * per_rank, args.micro_batches, per_rank),
            "stages_per_rank": per_rank,
        }
        runners["ours"].fabric.barrier()
    if rank == 0:
        emit(result)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------- memory
VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 512, 256, 8, 4, 512, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, D))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
        return self.tokens(tokens) + self.positions(position_ids)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens) if position_ids is None else self.embed(tokens, position_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        parallelize_module(layer, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def memory(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    layout = args.layout
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, args.seq), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, args.seq), generator=g)
    torch.manual_seed(0)
    if layout == "single":
        model = LM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            lm_loss(model(tokens), target).backward()
            optimizer.step()
            optimizer.zero_grad()

        params, world, rank = model.parameters, 1, 0
    else:
        from fabric_core import Fabric
        from fabric_fsdp import ModelParallelStrategy

        options = {
            "dp2": dict(parallelize_fn=_fsdp, data_parallel_size=2, tensor_parallel_size=1),
            "tp2": dict(parallelize_fn=tensor_parallel, data_parallel_size=1, tensor_parallel_size=2),
            "pp2": dict(pipeline_parallel_size=2, pipeline_split=["layers.2"], pipeline_micro_batches=BATCH),
            "sp2": dict(sequence_parallel_size=2),
        }[layout]
        fabric = Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(**options))
        fabric.launch()
        model = LM()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step() -> None:
            fabric.forward_backward(model, tokens, target=target, loss_fn=lm_loss, micro_batches=BATCH if layout == "pp2" else 1)
            optimizer.step()
            optimizer.zero_grad()

        params, world, rank = model.module.parameters, 2, fabric.global_rank
    step()  # the optimizer's state exists from here on
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    model_bytes = local_bytes(params())
    before = rss_kib() or 0
    reset_peak_rss()
    step()
    peak = (peak_rss_kib() or 0) - before
    row = torch.tensor([model_bytes, local_bytes(state), model_bytes, peak * 1024.0], dtype=torch.float64)
    if world > 1:
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        row = torch.stack(rows).max(0).values
    if rank == 0:
        keys = ("parameters", "optimizer_state", "gradients", "step_peak")
        emit({"layout": layout, "world": world, "per_rank_max_bytes": dict(zip(keys, row.tolist())), "model": _describe(args.seq)})
    if world > 1:
        fabric.teardown()


def _fsdp(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _describe(seq: int) -> str:
    params = sum(p.numel() for p in LM().parameters())
    return (
        f"decoder LM: {LAYERS} layers, width {D}, {HEADS} heads, vocab {VOCAB}, {params / 1e6:.2f} M parameters;"
        f" batch {BATCH} x {seq} tokens, AdamW, fp32"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("steady")
    s.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B")
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--micro-batches", type=int, default=4)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--rounds", type=int, default=8)
    s.add_argument("--round-steps", type=int, default=3)
    m = sub.add_parser("memory")
    m.add_argument("--layout", choices=("single", "dp2", "tp2", "pp2", "sp2"), required=True)
    m.add_argument("--seq", type=int, default=SEQ, help="tokens per sample (at most 512)")
    args = parser.parse_args()
    steady(args) if args.mode == "steady" else memory(args)


if __name__ == "__main__":
    main()
