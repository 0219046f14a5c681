"""``fabric.load_raw`` of a full checkpoint into an FSDP model whose modules rename keys while loading.

    python renaming_load.py OUTDIR   (two externally started ranks)

A LoRA-style layer keeps the base weights in ``qkv.linear`` and renames ``qkv.weight``/``qkv.bias`` to them in a
``load_state_dict`` pre-hook, as adapter libraries do, so a plain model's checkpoint loads into it. Rank 0 writes
that plain checkpoint; both ranks load it into the sharded LoRA model and compare the gathered weights.
"""

from __future__ import annotations

import fsdp_common as c
import torch
from torch import nn

from fabric_core import Fabric

D = 16


class LoRALinear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.lora_a = nn.Parameter(torch.zeros(2, d))
        self.lora_b = nn.Parameter(torch.zeros(d, 2))
        self._register_load_state_dict_pre_hook(self._base_keys_to_linear)

    def _base_keys_to_linear(self, state_dict, prefix, *args):
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x @ self.lora_a.t() @ self.lora_b.t()


class Plain(nn.Module):
    def __init__(self, lora: bool) -> None:
        super().__init__()
        self.qkv = LoRALinear(D) if lora else nn.Linear(D, D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.qkv(x)))


def main() -> None:
    out = c.out_dir()
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    source = Plain(lora=False)  # keys qkv.weight, qkv.bias, proj.weight, proj.bias
    if fabric.global_rank == 0:
        torch.save(source.state_dict(), out / "base.pt")
    fabric.barrier()

    torch.manual_seed(1)
    model = fabric.setup_module(Plain(lora=True))
    fabric.load_raw(out / "base.pt", model, strict=False)  # the LoRA parameters are not in the base checkpoint
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
    expected = {
        "qkv.linear.weight": source.qkv.weight, "qkv.linear.bias": source.qkv.bias,
        "proj.weight": source.proj.weight, "proj.bias": source.proj.bias,
    }  # fmt: skip
    result = {"diff": c.max_diff({k: full[k] for k in expected}, {k: v.detach() for k, v in expected.items()})}
    result["strict_error"] = c.expect_error(RuntimeError, "lora_a", fabric.load_raw, out / "base.pt", model)
    c.dump(out / f"rename{fabric.global_rank}.json", result)


if __name__ == "__main__":
    main()
