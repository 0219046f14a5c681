"""A language-model-like module whose output layer shares the embedding's weight, set up with FSDP on 2 ranks: once
with a wrap policy that splits the tied modules into different units (a warning), once keeping them in the root
(none). Writes the warnings rank 0 saw to ``<out>/tied.json``."""

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric
from fabric_fsdp import FSDPStrategy


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.embed(tokens))))


def main(out: Path) -> None:
    seen = {}
    for case, policy in (("split", {nn.Embedding, nn.Linear}), ("together", {nn.Linear})):
        fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(auto_wrap_policy=policy), devices=2)
        fabric.launch()
        model = TiedLM()
        if case == "together":
            model.head = nn.Linear(8, 16, bias=False)  # head in its own unit; nothing is tied any more
            model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
        error = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fabric.setup_module(model)(torch.tensor([[1, 2]])).sum().backward()
            except Exception as err:  # what FSDP2 itself makes of the split (recorded, not the point here)
                error = f"{type(err).__name__}: {err}"
        seen[case] = [str(w.message) for w in caught if "tied weights" in str(w.message)]
        seen[f"{case}_error"] = error
    if fabric.global_rank == 0:
        (out / "tied.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
