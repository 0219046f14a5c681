"""``compile_blocks`` composed with FSDP2 and activation checkpointing on 2 ranks: the blocks are compiled in place,
then sharded and checkpointed per block; the losses equal those of the eager model trained on the whole batch in
this process. Writes ``<out>/compile_blocks.json`` from rank 0."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.loop.compile import compile_blocks, is_compiled_block
from fabric_fsdp import FSDPStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *(Block() for _ in range(3)), nn.Linear(8, 1))


def main(out: Path) -> None:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    rank = fabric.global_rank
    model = make_model()
    names = compile_blocks(model, blocks=Block, backend="aot_eager")
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    reference = make_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(3, 8, 4)
    losses, ref_losses = [], []
    for step in range(3):
        loss = model(x[step][rank::2]).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        ref_loss = reference(x[step]).pow(2).mean()
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
    from torch.distributed._composable import checkpoint

    inner = model.module
    seen = {
        "compiled": names,
        "still_compiled": [is_compiled_block(m) for m in inner.modules() if isinstance(m, Block)],
        "checkpointed": [checkpoint.state(m) is not None for m in inner.modules() if isinstance(m, Block)],
        "losses": losses,
        "reference": ref_losses,
    }
    if rank == 0:
        (out / "compile_blocks.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
