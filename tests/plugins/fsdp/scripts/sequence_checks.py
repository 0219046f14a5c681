"""Run as 2 ranks (sequence 2) or 4 ranks (data parallel 2 x sequence 2): ``model_parallel``'s sequence axis (Ulysses)
end to end, on a tiny causal language model whose first block attends with ``F.scaled_dot_product_attention`` and
whose second with a user's attention function wrapped by ``strategy.ulysses``.

Two steps (one micro-batch, then two), targets with ignored tokens spread unevenly over the sequence halves, against
one process running the whole model on the whole sequences (loss and every gradient, then the weights after AdamW);
a sharded checkpoint (2 ranks; the test loads it into one process); the errors for a sequence length or head count the
axis does not divide and for a model that takes no positions. ``pipeline_checks.py`` runs
these checks in its job too (one job per layout); run alone, this writes ``result.json`` (rank 0).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, out_dir  # noqa: E402

from fabric_core import Fabric  # noqa: E402
from fabric_fsdp import ModelParallelStrategy  # noqa: E402

VOCAB, D, HEADS, SEQ, BATCH, LR = 11, 16, 4, 8, 4, 0.5


def my_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A user's causal attention, written out (no SDPA inside)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, attention, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(self.attention(q, k, v).transpose(1, 2).reshape(b, s, D))


class Block(nn.Module):
    def __init__(self, attention, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(attention, heads)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(64, D)
        self.blocks = nn.ModuleList([Block(sdpa, heads), Block(my_attention, heads)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        h = self.embed(tokens) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class NoPositions(TinyLM):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # ignore_index=-100, torch's default


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """The second block's own attention function through the all-to-all; FSDP2 over data x sequence."""
    from torch.distributed.fsdp import fully_shard

    from fabric_fsdp import ulysses

    model.blocks[1].attn.attention = ulysses(my_attention, mesh["sequence"].get_group())
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_sequence"])
    fully_shard(model, mesh=mesh["data_sequence"])
    return model


def batch(seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    target[:, :3] = -100  # ignored tokens, all in the first half of the sequence: the halves count differently
    target[0, :] = -100
    return tokens, target


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def worst(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sequence_checks(world: int, result: dict) -> None:
    """Sequence parallel 2 (x data parallel 2 on 4 ranks): two steps against one process, a checkpoint, the errors."""
    dp = world // 2
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, sequence_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    mesh = strategy.device_mesh
    result["mesh"] = [list(mesh.mesh_dim_names), list(mesh.shape)]
    result["coordinates"] = fabric.all_gather(torch.tensor(list(strategy.coordinates().values()))).tolist()
    result["sampler"] = [strategy.distributed_sampler_kwargs["num_replicas"], strategy.distributed_sampler_kwargs["rank"]]
    result["axes"] = [[a.name, a.size, a.role] for a in fabric.topology.axes]
    torch.manual_seed(0)
    model, reference = TinyLM(), TinyLM()
    reference.load_state_dict(model.state_dict())
    # SGD: AdamW would blow up the float noise of gradients that are zero in exact arithmetic (the key bias) into
    # whole learning-rate steps, so weights after it could not be compared; the gradients themselves are compared
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    row = strategy.data_parallel_rank
    record = result["steps"] = {"loss": [], "ref_loss": [], "grad_diff": []}
    for step, micro_batches in enumerate((1, 2)):
        tokens, target = batch(10 * step + row)
        rows = [batch(10 * step + r) for r in range(dp)]
        loss = fabric.forward_backward(model, tokens, target=target, loss_fn=loss_fn, micro_batches=micro_batches)
        loss = fabric.all_reduce(loss, reduce_op="mean")  # over the data-parallel rows (sequence peers agree)
        # one process, whole sequences: each row's batch the way micro-batches weigh it, rows averaged as DP does
        ref_loss = sum(
            sum(loss_fn(reference(t), y) for t, y in zip(r[0].chunk(micro_batches), r[1].chunk(micro_batches))) / micro_batches
            for r in rows
        ) / dp
        ref_loss.backward()
        record["loss"].append(float(loss))
        record["ref_loss"].append(float(ref_loss))
        ref = dict(reference.named_parameters())
        record["grad_diff"].append(worst(max(float((full(p.grad) - ref[n].grad).abs().max()) for n, p in model.module.named_parameters())))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    ref = dict(reference.named_parameters())
    record["param_diff"] = worst(max(float((full(p) - ref[n]).abs().max()) for n, p in model.module.named_parameters()))
    mark("sequence parallel trained")

    if world == 2:
        out = out_dir()
        fabric.save(out / "sequence_ckpt", {"model": model, "step": 2})
        expected = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
        if fabric.global_rank == 0:
            torch.save(expected, out / "sequence_expected.pt")
        mark("saved")

    # errors: a sequence length the axis does not divide, a head count it does not divide, no positions argument
    tokens, target = batch(0, seq=SEQ - 1)
    result["length_error"] = expect_error(
        ValueError, f"{SEQ - 1} positions", fabric.forward_backward, model, tokens, target=target, loss_fn=loss_fn
    )
    one_head = fabric.setup_module(TinyLM(heads=1))
    tokens, target = batch(0)
    result["heads_error"] = expect_error(
        ValueError, "has 1 head(s)", fabric.forward_backward, one_head, tokens, target=target, loss_fn=loss_fn
    )
    result["positions_error"] = expect_error(TypeError, "position_ids", fabric.setup_module, NoPositions())
    mark("sequence errors")
    fabric.teardown()


def main() -> None:
    world = int(sys.argv[2])
    result: dict = {"world": world}
    sequence_checks(world, result)
    if os.environ["RANK"] == "0":
        dump(out_dir() / "result.json", result)
    mark("done")


if __name__ == "__main__":
    main()
