"""The seeds' five steps on one XLA device: ``python skeleton.py OUT`` writes ``OUT/skeleton.json``.

The conversion guide's loop (a small Transformer language model, ``nll_loss`` on next-token targets) through
``Fabric(accelerator="tpu", devices=1)`` on the CPU PJRT device, compared with the same loop in plain PyTorch.
"""

from __future__ import annotations

import torch
import xla_common as c
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric

VOCAB, SEQ, D_MODEL = 64, 16, 32


class Transformer(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, D_MODEL)
        self.encoder = nn.TransformerEncoderLayer(D_MODEL, 4, 2 * D_MODEL, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D_MODEL, vocab_size)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.out(self.encoder(self.embed(input))), dim=-1).view(-1, VOCAB)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(vocab_size=VOCAB)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    out = c.out_dir()
    fabric = Fabric(accelerator="tpu", devices=1)  # step 1
    fabric.launch()  # step 2 (one device: nothing to start)

    dataloader = data()
    model, optimizer = build()
    model, optimizer = fabric.setup(model, optimizer)  # step 3
    dataloader = fabric.setup_dataloaders(dataloader)
    model.train()
    losses = []
    for _ in range(3):
        for batch in dataloader:
            input, target = batch  # step 4: no .to(device)
            optimizer.zero_grad()
            output = model(input, target)
            loss = torch.nn.functional.nll_loss(output, target.view(-1))
            fabric.backward(loss)  # step 5
            optimizer.step()
            losses.append(loss.detach())
    losses = [float(x.item()) for x in losses]
    fabric.save(out / "skeleton.ckpt", {"model": model, "optimizer": optimizer, "epoch": 3}).wait()

    ref_model, ref_optimizer = build()
    ref_losses = []
    for _ in range(3):
        for input, target in data():
            ref_optimizer.zero_grad()
            loss = torch.nn.functional.nll_loss(ref_model(input, target), target.view(-1))
            loss.backward()
            ref_optimizer.step()
            ref_losses.append(loss.item())
    c.dump(
        out / "skeleton.json",
        {
            "strategy": type(fabric.strategy).__name__,
            "device": str(fabric.device),
            "losses": losses,
            "ref_losses": ref_losses,
            "param_diff": c.max_param_diff(model, ref_model),
            "checkpoint_all_cpu": c.all_cpu(torch.load(out / "skeleton.ckpt", weights_only=True)),
        },
    )


if __name__ == "__main__":
    main()
