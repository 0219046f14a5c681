"""2 ranks: which FSDP units stay gathered after forward, all-gathers per step, and no stale weights after a step.

The default model has two units: the root and the ``nn.TransformerEncoderLayer`` (``enc``). Per configuration
this records, after a forward with gradients, whether the root's own parameters (``inp``) and the unit's
(``enc``) are still the gathered plain tensors (FSDP registers those while gathered, ``DTensor`` shards
otherwise), the number of all-gathers one training step makes, and whether a forward under ``no_grad`` followed
by ``optimizer.step()`` leaves the next forward computing with the updated weights. Writes ``reshard.json``.
"""

from __future__ import annotations

import fsdp_common as c
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from fabric_core import Fabric
from fabric_fsdp import FSDPStrategy


def gathered(inner: nn.Module) -> dict[str, bool]:
    return {"root": not isinstance(inner.inp.weight, DTensor), "enc": not isinstance(inner.enc.linear1.weight, DTensor)}


def probe(strategy, opt_in_root: bool = False) -> dict:
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = fabric.setup_module(c.make_model())
    if opt_in_root:
        model.set_reshard_after_forward(True, recurse=False)  # torch's own switch, through the Fabric wrapper
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    inner = model.module
    names = [n for n, _ in inner.named_parameters()]  # the optimizer's order
    x, y = c.make_data(1, world)
    x, y = c.local(x[0], rank), c.local(y[0], rank)

    def step(record: dict | None = None) -> int:
        optimizer.zero_grad()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = nn.functional.mse_loss(model(x), y)
            if record is not None:
                record.update(gathered(inner))
            fabric.backward(loss)
            optimizer.step()
        # One "FSDP::all_gather" region per unit gathered ("FSDP::all_gather (enc)" for a unit below the root).
        return sum(e.count for e in prof.key_averages() if e.key.split(" (")[0] == "FSDP::all_gather")

    step()  # the first forward decides which module is the root
    after_forward: dict = {}
    gathers = step(after_forward)
    sharded_after_step = not any(gathered(inner).values())

    # Evaluation between backward and step: the units that keep their gathered copy must not keep it past the
    # step, or the next forward would run with the weights from before it.
    optimizer.zero_grad()
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with torch.no_grad():
        model(x)
    gathered_after_no_grad_forward = gathered(inner)
    optimizer.step()
    with torch.no_grad():
        out = model(x)
    # The weights the optimizer updated (its sharded parameters), not whatever the model has registered now.
    reference = c.make_model()
    reference.load_state_dict({n: p.detach().full_tensor() for n, p in zip(names, optimizer.param_groups[0]["params"])})
    with torch.no_grad():
        expected = reference(x)
    return {
        "gathered_after_forward": after_forward,
        "all_gathers_per_step": gathers,
        "sharded_after_step": sharded_after_step,
        "gathered_after_no_grad_forward": gathered_after_no_grad_forward,
        "forward_after_step_diff": float((out - expected).abs().max()),
    }


def main() -> None:
    out = c.out_dir()
    results = {
        "default": probe("fsdp"),
        "none": probe(FSDPStrategy(reshard_after_forward=None)),
        "no_reshard": probe("fsdp_no_reshard"),
        "root_opt_in": probe("fsdp", opt_in_root=True),
    }
    if torch.distributed.get_rank() == 0:
        c.dump(out / "reshard.json", results)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
