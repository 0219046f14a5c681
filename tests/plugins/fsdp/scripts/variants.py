"""2 ranks: the strategy's options and precisions, each trained against the single-process reference.

Every variant is a new Fabric in the same processes (the process group is created once). Results go to
``variants.json``: per variant the losses, the reference losses, the largest parameter difference after
training, and what the variant should have changed.
"""

from __future__ import annotations

import warnings

import fsdp_common as c
import torch
from torch import nn

from fabric_core import Fabric
from fabric_fsdp import FSDPPrecision, FSDPStrategy

STEPS = 4


def train(fabric: Fabric, steps: int = STEPS):
    rank, world = fabric.global_rank, fabric.world_size
    model = fabric.setup_module(c.make_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    x, y = c.make_data(steps, world)
    losses = []
    for s in range(steps):
        optimizer.zero_grad()
        out = model(c.local(x[s], rank))
        loss = nn.functional.mse_loss(out.float(), c.local(y[s], rank))
        fabric.backward(loss)
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return model, optimizer, losses, out


def reference(steps: int = STEPS) -> tuple[nn.Module, list[float]]:
    model = c.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    x, y = c.make_data(steps, 2)
    losses = []
    for s in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return model, losses


def main() -> None:
    out = c.out_dir()
    ref_model, ref_losses = reference()
    ref_params = c.full_params(ref_model)
    results: dict = {"ref_losses": ref_losses}

    def run(name: str, strategy, precision=None, **extra) -> tuple:
        c.Block.calls = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision)
            fabric.launch()
            model, optimizer, losses, output = train(fabric)
        from torch.distributed.fsdp import FSDPModule

        inner = model.module
        results[name] = {
            "losses": losses,
            "param_diff": c.max_diff(c.full_params(inner), ref_params),
            "units": sorted(n for n, m in inner.named_modules() if isinstance(m, FSDPModule)),
            "mesh": list(fabric.strategy.device_mesh.shape),
            "local_numel": sum(p.to_local().numel() for p in inner.parameters()),
            "full_numel": sum(p.numel() for p in inner.parameters()),
            "param_dtype": str(next(inner.parameters()).dtype),
            "output_dtype": str(output.dtype),
            "precision": type(fabric.strategy.precision).__name__,
            "warnings": [str(w.message) for w in caught if "cpu_offload" in str(w.message)],
            "block_calls_per_step": c.Block.calls / STEPS,
            **extra,
        }
        c.mark(name)
        return fabric, model, optimizer

    c.mark("start")
    run("blocks_checkpointed", FSDPStrategy(auto_wrap_policy={c.Block}, activation_checkpointing={c.Block}))
    run("no_reshard", "fsdp_no_reshard")
    run("hybrid", "fsdp_hybrid")
    fabric, _, _ = run("replicated", FSDPStrategy(sharding_strategy="NO_SHARD", auto_wrap_policy={c.Block}))
    # Meta init on a (replicate=2, shard=1) mesh: replicas of a shard must be initialised identically.
    with fabric.init_module(empty_init=True):
        meta_model = c.Net()
    meta_model = fabric.setup_module(meta_model)
    local = torch.cat([p.to_local().detach().flatten() for p in meta_model.parameters()])
    gathered = fabric.all_gather(local)
    results["replicated"]["meta_init_replicas_equal"] = bool(torch.equal(gathered[0], gathered[1]))
    run("cpu_offload", "fsdp_cpu_offload")
    run("bf16_mixed", "fsdp", "bf16-mixed")
    run("bf16_true", "fsdp", "bf16-true")
    fabric, model, optimizer = run("fp16_mixed", FSDPStrategy(precision=FSDPPrecision("16-mixed")))
    scaler = fabric.strategy.precision.scaler
    results["fp16_mixed"]["scaler"] = type(scaler).__name__
    fabric.save(out / "fp16_sharded", {"model": model, "optimizer": optimizer})
    from fabric_fsdp.checkpoint import read_meta

    meta, _ = read_meta(out / "fp16_sharded")
    results["fp16_mixed"]["scale_saved"] = float(meta["__fabric_precision__"]["scale"])
    results["fp16_mixed"]["scale"] = float(scaler.get_scale())
    if fabric.global_rank == 0:
        c.dump(out / "variants.json", results)
    fabric.barrier()


if __name__ == "__main__":
    main()
