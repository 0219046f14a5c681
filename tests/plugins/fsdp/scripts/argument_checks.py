"""2 ranks: the reference's FSDP1 arguments on FSDP2 (policies, MixedPrecision, CPUOffload, sharding strategies,
FSDP1 keyword arguments) and the checkpoint guard rails. Every configuration is a new Fabric in the same
processes (the process group is created once). Writes ``arguments.json``; the assertions are in
``test_arguments.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import fsdp_common as c
import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffload,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from variants import STEPS, reference

from fabric_core import Fabric
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_fsdp import FSDPStrategy

IO_CALLS: list[dict] = []


class RecordingIO(TorchCheckpointIO):
    """Records the calls and takes `storage_options` (the default CheckpointIO refuses them)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        IO_CALLS.append({"storage_options": storage_options})
        return super().save_checkpoint(checkpoint, path)


def new_fabric(strategy, precision=None) -> Fabric:
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision)
    fabric.launch()
    return fabric


def units(inner: nn.Module) -> list[str]:
    return sorted(n for n, m in inner.named_modules() if isinstance(m, FSDPModule))


def full_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.flatten() for t in c.full_params(model).values()])


def record_dtype(seen: dict, key) -> Callable:
    """A forward hook noting the first output dtype under ``key`` (returning None: the output is unchanged)."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        seen.setdefault(key, str(output.dtype))

    return hook


def train(fabric: Fabric, model: nn.Module):
    """``STEPS`` steps of variants.reference's loop, each rank on its part of the global batch."""
    rank, world = fabric.global_rank, fabric.world_size
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    x, y = c.make_data(STEPS, world)
    losses = []
    for s in range(STEPS):
        optimizer.zero_grad()
        out = model(c.local(x[s], rank))
        loss = nn.functional.mse_loss(out.float(), c.local(y[s], rank))
        fabric.backward(loss)
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return model, optimizer, losses, out


def main() -> None:
    out = c.out_dir()
    _, ref_losses = reference()
    results: dict = {"ref_losses": ref_losses}

    def run(name: str, strategy, precision=None) -> tuple:
        """Train like the reference; record units, recomputed forwards and the dtypes inside the model."""
        c.Block.calls = 0
        seen: dict = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric = new_fabric(strategy, precision)
            model = c.make_model()
            hook = model.blocks[0].lin.register_forward_hook(record_dtype(seen, "compute"))
            model, optimizer, losses, output = train(fabric, model)
            hook.remove()
        inner = model.module
        results[name] = {
            "losses": losses,
            "units": units(inner),
            "mesh": list(fabric.strategy.device_mesh.shape),
            "block_calls_per_step": c.Block.calls / STEPS,
            "compute_dtype": seen.get("compute"),
            "param_dtype": str(next(inner.parameters()).dtype),
            "output_dtype": str(output.dtype),
            "precision": type(fabric.strategy.precision).__name__,
            "warnings": [str(w.message) for w in caught],
            "offload_warnings": [str(w.message) for w in caught if "cpu_offload" in str(w.message)],
        }
        c.mark(name)
        return fabric, model, optimizer

    c.mark("start")
    # ---------------------------------------------------------------- policies
    run("module_wrap_policy", FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({c.Block}), activation_checkpointing_policy=ModuleWrapPolicy({c.Block})))
    run(
        "custom_and_fsdp1_callable",
        FSDPStrategy(
            auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, c.Block)),
            activation_checkpointing_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, c.Block),
        ),
    )
    size_based = functools.partial(size_based_auto_wrap_policy, min_num_params=300)
    run("size_based", FSDPStrategy(auto_wrap_policy=size_based, activation_checkpointing_policy=size_based))
    fabric = new_fabric(FSDPStrategy(auto_wrap_policy=CustomPolicy(lambda m: {"reshard_after_forward": False} if isinstance(m, c.Block) else False)))
    results["custom_policy_with_kwargs"] = c.expect_error(ValueError, "per-module", fabric.setup_module, c.make_model())

    # ---------------------------------------------------------------- mixed precision
    fsdp1_mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    run("fsdp1_mixed_precision", FSDPStrategy(mixed_precision=fsdp1_mp))
    run("mixed_precision_wins", FSDPStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float16)), "bf16-mixed")

    # ---------------------------------------------------------------- offload, sharding strategies
    run("cpu_offload_false", FSDPStrategy(cpu_offload=CPUOffload(offload_params=False)))
    run("cpu_offload_true", FSDPStrategy(cpu_offload=CPUOffload(offload_params=True)))
    for name, value in (("hybrid_zero2", ShardingStrategy._HYBRID_SHARD_ZERO2), ("hybrid", "HYBRID_SHARD")):
        fabric, model, _ = run(name, FSDPStrategy(sharding_strategy=value))
        model(torch.randn(c.BATCH, c.D_IN))
        results[name]["enc_gathered_after_forward"] = not isinstance(model.module.enc.linear1.weight, DTensor)

    # ---------------------------------------------------------------- FSDP1 keyword arguments
    rank = fabric.global_rank
    rank0_model = full_of(c.make_model(seed=0))
    for name, sync in (("sync_module_states", True), ("no_sync_module_states", False)):
        fabric = new_fabric(FSDPStrategy(sync_module_states=sync))
        model = fabric.setup_module(c.make_model(seed=rank))  # each rank starts from different weights
        results[name] = {"diff_to_rank0_model": float((full_of(model.module) - rank0_model).abs().max())}

    for name in ("ignored_modules", "ignored_states"):
        model = c.make_model()
        ignored = [model.blocks[1]] if name == "ignored_modules" else list(model.blocks[1].parameters())
        ignored_params = list(model.blocks[1].parameters())
        fabric = new_fabric(FSDPStrategy(auto_wrap_policy={c.Block}, **{name: ignored}))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        x, y = c.make_data(1, 2)
        loss = nn.functional.mse_loss(model(c.local(x[0], rank)), c.local(y[0], rank))
        fabric.backward(loss)
        optimizer.step()
        others = [p for n, p in model.module.named_parameters() if not n.startswith("blocks.1.")]
        results[name] = {
            "units": units(model.module),
            "ignored_plain_full": all(not isinstance(p, DTensor) and p.shape == q.shape for p, q in zip(model.module.blocks[1].parameters(), c.make_model().blocks[1].parameters())),
            "ignored_same_objects": all(a is b for a, b in zip(model.module.blocks[1].parameters(), ignored_params)),
            "others_sharded": all(isinstance(p, DTensor) for p in others),
            "ignored_have_grads": all(p.grad is not None for p in ignored_params),
            "finite": bool(torch.isfinite(loss)),
        }
        if name == "ignored_modules":  # a sharded checkpoint keeps one rank's copy of them (they may differ)
            fabric.save(out / "ignored", {"model": model})
            fresh = c.make_model(seed=3)
            fabric = new_fabric(FSDPStrategy(auto_wrap_policy={c.Block}, ignored_modules=[fresh.blocks[1]]))
            fresh = fabric.setup_module(fresh)
            fabric.load(out / "ignored", {"model": fresh})
            mine = torch.cat([p.detach().flatten() for p in model.module.blocks[1].parameters()])
            copies = fabric.all_gather(mine)
            restored = fabric.all_gather(torch.cat([p.detach().flatten() for p in fresh.module.blocks[1].parameters()]))
            results[name]["ranks_differed"] = not torch.equal(copies[0], copies[1])  # gradients are not reduced
            results[name]["restored_same_on_ranks"] = torch.equal(restored[0], restored[1])
            results[name]["restored_is_a_rank_copy"] = any(torch.equal(restored[0], copy) for copy in copies)
            results[name]["restored_sharded_diff"] = c.max_diff(
                {k: v for k, v in c.full_params(fresh.module).items() if not k.startswith("blocks.1.")},
                {k: v for k, v in c.full_params(model.module).items() if not k.startswith("blocks.1.")},
            )
    with fabric.init_module(empty_init=True):
        meta_model = c.Net()
    fabric = new_fabric(FSDPStrategy(auto_wrap_policy={c.Block}, ignored_modules=[meta_model.blocks[1]]))
    meta_model = fabric.setup_module(meta_model)
    unsharded = torch.cat([p.detach().flatten() for p in meta_model.module.blocks[1].parameters()])
    gathered = fabric.all_gather(unsharded)
    results["ignored_meta_init_equal_across_ranks"] = bool(torch.equal(gathered[0], gathered[1]))
    c.mark("fsdp1 kwargs")

    fabric = new_fabric(FSDPStrategy(device_id=torch.device("cuda", 0)))
    results["device_id_mismatch"] = c.expect_error(ValueError, "device_id", fabric.setup_module, c.make_model())
    fabric = new_fabric(FSDPStrategy(device_id=torch.device("cpu")))
    results["device_id_cpu_ok"] = is_fsdp_model(fabric.setup_module(c.make_model()).module)

    # A unit sharded by hand before setup keeps its own policy: blocks.0 in float32 in a bf16 model, the way the
    # BatchNorm warning says.
    fabric = new_fabric(FSDPStrategy(auto_wrap_policy={c.Block}, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)))
    model = c.make_model()
    keep = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    fully_shard(model.blocks[0], mesh=fabric.strategy.device_mesh, mp_policy=keep)
    dtypes: dict = {}
    for i in (0, 1):
        model.blocks[i].lin.register_forward_hook(record_dtype(dtypes, i))
    model = fabric.setup_module(model)
    output = model(torch.randn(c.BATCH, c.D_IN))
    fabric.backward(output.float().square().mean())
    finite = all(torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
    results["presharded"] = {"units": units(model.module), "block_dtypes": [dtypes[0], dtypes[1]], "finite": bool(finite)}
    c.mark("device_id, presharded")

    # ---------------------------------------------------------------- checkpoints
    fabric = new_fabric(FSDPStrategy(state_dict_type="full", checkpoint_io=RecordingIO()))
    model = fabric.setup_module(c.make_model())
    fabric.strategy.save_checkpoint(out / "full.ckpt", {"model": model.module}, storage_options={"bucket": "b"})
    results["io_calls_per_rank"] = fabric.all_gather(torch.tensor(len(IO_CALLS))).tolist()
    if rank == 0:
        results["io_storage_options"] = IO_CALLS[0]["storage_options"]

    fabric = new_fabric("fsdp")
    model = fabric.setup_module(c.make_model())
    results["sharded_storage_options"] = c.expect_error(
        TypeError, "storage_options", fabric.strategy.save_checkpoint, out / "sharded", {"model": model.module}, storage_options={"a": 1}
    )
    fabric.save(out / "sharded", {"model": model})
    other = fabric.setup_module(c.make_model())
    results["two_models_load"] = c.expect_error(ValueError, "FSDP models", fabric.load, out / "sharded", {"model": model, "other": other})

    # load_raw: a plain PyTorch AdamW state (3 steps) into the sharded optimizer of the same model.
    plain = c.make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = c.make_data(3, 2)
    for s in range(3):
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x[s]), y[s]).backward()
        plain_opt.step()
    if rank == 0:
        torch.save(plain_opt.state_dict(), out / "raw_optimizer.pt")
    fabric.barrier()
    model = fabric.setup_module(c.make_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load_raw(out / "raw_optimizer.pt", optimizer)
    state = optimizer.optimizer.state
    diffs, steps = [], set()
    for (_, param), (_, plain_param) in zip(model.module.named_parameters(), plain.named_parameters()):
        exp_avg = state[param]["exp_avg"]
        exp_avg = exp_avg.full_tensor() if isinstance(exp_avg, DTensor) else exp_avg
        diffs.append(float((exp_avg - plain_opt.state[plain_param]["exp_avg"]).abs().max()))
        steps.add(float(state[param]["step"]))
    results["load_raw_optimizer_exp_avg_diff"] = max(diffs)
    results["load_raw_optimizer_step"] = steps.pop() if len(steps) == 1 else sorted(steps)
    c.mark("checkpoints")

    if rank == 0:
        c.dump(out / "arguments.json", results)
    fabric.barrier()


def is_fsdp_model(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


if __name__ == "__main__":
    main()
