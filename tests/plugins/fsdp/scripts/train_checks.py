"""2 ranks: FSDP training vs a single-process reference, sharding, no_backward_sync, clipping, checkpoints.

Writes into OUT (argv[1]): ``sharded/`` and ``full.ckpt`` checkpoints, ``reference.pt`` (the reference model's
weights and optimizer state after training) and ``result.json`` (numbers the test asserts on).
"""

from __future__ import annotations

import os

import fsdp_common as c
import torch
from torch import nn

from fabric_core import Fabric

STEPS = 5


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def main() -> None:
    out = c.out_dir()
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    c.mark("launched")
    rank, world = fabric.global_rank, fabric.world_size
    result: dict = {}

    # Joint setup: the optimizer is created before sharding and must be rewired to the sharded parameters.
    model = c.make_model()
    full_numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    c.mark("setup")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    inner = model.module
    result["fsdp_units"] = sorted(n for n, m in inner.named_modules() if isinstance(m, FSDPModule))
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    result["optimizer_params_sharded"] = all(isinstance(p, DTensor) for p in opt_params)
    result["optimizer_params_are_model_params"] = {id(p) for p in opt_params} == {id(p) for p in inner.parameters()}
    local_numel = sum(p.to_local().numel() for p in inner.parameters())
    result["local_numel"] = fabric.all_gather(torch.tensor(local_numel)).tolist()
    result["full_numel"] = full_numel

    x, y = c.make_data(STEPS, world)
    losses, norms = [], []
    for s in range(STEPS):
        optimizer.zero_grad()
        if s == c.ACCUMULATE_AT:
            xs, ys = c.halves(x[s], world), c.halves(y[s], world)
            mine = lambda t: t[rank * (c.BATCH // 2) : (rank + 1) * (c.BATCH // 2)]  # noqa: E731
            with fabric.no_backward_sync(model, enabled=True):
                fabric.backward(nn.functional.mse_loss(model(mine(xs[0])), mine(ys[0])))
            result["grads_after_no_sync"] = [p.grad is None for p in inner.parameters()]
            fabric.backward(nn.functional.mse_loss(model(mine(xs[1])), mine(ys[1])))
            with torch.no_grad():
                loss = nn.functional.mse_loss(model(c.local(x[s], rank)), c.local(y[s], rank))
        else:
            loss = nn.functional.mse_loss(model(c.local(x[s], rank)), c.local(y[s], rank))
            fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=c.MAX_NORM)
        result.setdefault("norm_types", set()).add(type(norm).__name__)
        norms.append(float(norm))
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    result["norm_types"] = sorted(result["norm_types"])
    c.mark("trained")
    result["losses"], result["norms"] = losses, norms

    ref_model, ref_opt, ref_losses, ref_norms = c.reference_run(STEPS, world)
    result["ref_losses"], result["ref_norms"] = ref_losses, ref_norms
    result["param_diff_vs_reference"] = c.max_diff(c.full_params(inner), c.full_params(ref_model))
    if rank == 0:
        torch.save({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()}, out / "reference.pt")

    # ---------------------------------------------------------------- checkpoints
    counter = Counter()
    counter.n = 7
    state = {"model": model, "optimizer": optimizer, "step": STEPS, "counter": counter}
    fabric.save(out / "sharded", state)
    c.mark("saved sharded")
    first_files = sorted(os.listdir(out / "sharded"))
    fabric.save(out / "sharded", state)  # overwrite an existing checkpoint: swapped in, not mixed
    result["sharded_files"] = sorted(os.listdir(out / "sharded"))
    result["sharded_files_stable"] = first_files == result["sharded_files"]
    result["leftovers"] = sorted(n for n in os.listdir(out) if n.startswith("."))
    fabric.strategy.state_dict_type = "full"
    fabric.save(out / "full.ckpt", state)
    fabric.save(out / "filtered.ckpt", {"model": model}, filter={"model": lambda k, v: "bias" not in k})
    fabric.strategy.state_dict_type = "sharded"
    c.mark("saved full")

    # Reload the sharded checkpoint into a fresh FSDP model and optimizer on the same ranks.
    saved = c.full_params(inner)
    model2 = fabric.setup_module(c.make_model(seed=123))
    optimizer2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2, eps=1e-4))
    fresh = Counter()
    state2 = {"model": model2, "optimizer": optimizer2, "step": 0, "counter": fresh}
    remainder = fabric.load(out / "sharded", state2)
    result["load_remainder"] = sorted(remainder)
    c.mark("loaded sharded")
    result["loaded_step"] = state2["step"]
    result["loaded_counter"] = fresh.n
    result["reload_param_diff"] = c.max_diff(c.full_params(model2.module), c.full_params(inner))
    # One more identical step on both: equal only if the optimizer state (AdamW moments) was restored.
    for m, o in ((model, optimizer), (model2, optimizer2)):
        o.zero_grad()
        fabric.backward(nn.functional.mse_loss(m(c.local(x[0], rank)), c.local(y[0], rank)))
        o.step()
    result["after_step_diff"] = c.max_diff(c.full_params(model2.module), c.full_params(inner))

    # The full file loads into FSDP as well (every rank reads it and keeps its shard).
    model3 = fabric.setup_module(c.make_model(seed=5))
    optimizer3 = fabric.setup_optimizers(torch.optim.AdamW(model3.parameters(), lr=1e-2, eps=1e-4))
    state3 = {"model": model3, "optimizer": optimizer3, "counter": Counter()}
    remainder3 = fabric.load(out / "full.ckpt", state3)
    result["full_load_remainder"] = sorted(remainder3)
    c.mark("loaded full")
    result["full_load_param_diff"] = c.max_diff(c.full_params(model3.module), saved)
    optimizer3.zero_grad()
    fabric.backward(nn.functional.mse_loss(model3(c.local(x[0], rank)), c.local(y[0], rank)))
    optimizer3.step()
    result["full_load_after_step_diff"] = c.max_diff(c.full_params(model3.module), c.full_params(model2.module))
    # ---------------------------------------------------------------- bad inputs
    errors = {}
    errors["two_models"] = c.expect_error(ValueError, "FSDP models", fabric.save, out / "bad", {"a": model, "b": model2})
    errors["filter_sharded"] = c.expect_error(
        NotImplementedError, "filter", fabric.save, out / "bad", {"model": model}, filter={"model": lambda k, v: True}
    )
    with fabric.init_module(empty_init=True):
        meta_model = c.Net()
    meta_opt = torch.optim.SGD(meta_model.parameters(), lr=0.1)
    errors["meta_joint_setup"] = c.expect_error(RuntimeError, "meta-device", fabric.setup, meta_model, meta_opt)
    errors["stale_optimizer"] = c.expect_error(
        ValueError, "does not seem to reference any FSDP parameters", fabric.setup_optimizers, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    )
    os.makedirs(out / "user_dir", exist_ok=True)
    (out / "user_dir" / "notes.txt").write_text("precious")
    errors["non_checkpoint_dir"] = c.expect_error(FileExistsError, "not an FSDP checkpoint", fabric.save, out / "user_dir", state)
    # A save that fails on one rank after the shards were written: the old checkpoint must survive intact.
    before = sorted(os.listdir(out / "sharded"))
    unpicklable = {"model": model, "optimizer": optimizer, "step": lambda: None}  # meta.pt cannot hold a lambda
    kind = Exception if rank == 0 else RuntimeError
    errors["failed_save"] = c.expect_error(kind, "", fabric.save, out / "sharded", unpicklable)
    check = {"model": fabric.setup_module(c.make_model(seed=77)), "step": 0}
    fabric.load(out / "sharded", check, strict=False)
    result["after_failed_save"] = {
        "files_unchanged": sorted(os.listdir(out / "sharded")) == before,
        "leftovers": sorted(n for n in os.listdir(out) if n.startswith(".")),
        "old_step": check["step"],
        "old_params_diff": c.max_diff(c.full_params(check["model"].module), saved),
    }
    result["errors"] = errors
    c.mark("errors checked")
    result["bad_dir_untouched"] = not os.path.exists(out / "bad") and (out / "user_dir" / "notes.txt").read_text() == "precious"

    if rank == 0:
        c.dump(out / "result.json", result)
    fabric.barrier()


if __name__ == "__main__":
    main()
