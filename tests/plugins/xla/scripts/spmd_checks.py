"""SPMD sharding on virtual CPU devices: ``CPU_NUM_DEVICES=N python spmd_checks.py OUT`` writes ``OUT/spmd-N.json``.

``strategy="fsdp"`` on the ``tpu`` accelerator becomes ``xla_fsdp`` (FSDPv2 under SPMD); parameters and batches are
split over the N devices; the losses match the single-device eager reference on the same global batches; a
checkpoint holds whole CPU tensors under the plain model's keys, loads back keeping the sharding (the optimizer
state too) and into a plain CPU model; the same with an ``auto_wrap_policy`` (nested FSDPv2 units).
"""

from __future__ import annotations

import functools
import os

import torch
import xla_common as c
from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy

from fabric_core import Fabric
from fabric_xla import XLAFSDPStrategy, sharding


def run(fabric: Fabric, r: dict, prefix: str) -> None:
    model = c.make_model()
    optimizer = c.make_optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    r[prefix + "param_shardings"] = [sharding.parameter_sharding(p) for p in model.parameters()]
    r[prefix + "units"] = sum(sharding.is_sharded_module(m) for m in model.modules())
    inputs: list[str] = []
    hook = model.module.register_forward_pre_hook(lambda module, args: inputs.append(sharding.parameter_sharding(args[0])))
    loader = fabric.setup_dataloaders(c.dataloader())
    r[prefix + "losses"] = c.train(fabric, model, optimizer, loader)
    hook.remove()
    r[prefix + "input_sharding"] = inputs[0]
    _, y = next(iter(loader))
    r[prefix + "label_sharding"] = sharding.parameter_sharding(y)
    r[prefix + "param_diff"] = c.max_param_diff(model, REF_MODEL)
    r[prefix + "state_shardings"] = [
        sharding.parameter_sharding(v) for s in optimizer.optimizer.state.values() for v in s.values() if v.device.type == "xla"
    ]

    path = c.out_dir() / f"{prefix}spmd.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 8}).wait()
    raw = torch.load(path, weights_only=True)
    r[prefix + "checkpoint_keys"] = list(raw["model"])
    r[prefix + "checkpoint_shapes_whole"] = all(raw["model"][k].shape == v.shape for k, v in REF_MODEL.state_dict().items())
    r[prefix + "checkpoint_all_cpu"] = c.all_cpu(raw)
    plain = c.make_model(seed=3)
    plain.load_state_dict(raw["model"])
    r[prefix + "plain_param_diff"] = c.max_param_diff(plain, model)

    restored = c.make_model(seed=7)
    restored_optimizer = c.make_optimizer(restored)
    restored, restored_optimizer = fabric.setup(restored, restored_optimizer)
    r[prefix + "load_remainder"] = fabric.load(path, {"model": restored, "optimizer": restored_optimizer})
    r[prefix + "restored_param_diff"] = c.max_param_diff(restored, model)
    r[prefix + "restored_param_shardings"] = [sharding.parameter_sharding(p) for p in restored.parameters()]
    r[prefix + "restored_state_shardings"] = [
        sharding.parameter_sharding(v)
        for s in restored_optimizer.optimizer.state.values()
        for v in s.values()
        if v.device.type == "xla"
    ]
    r[prefix + "continued"] = c.train(fabric, model, optimizer, loader, epochs=1)
    r[prefix + "restored_continued"] = c.train(fabric, restored, restored_optimizer, loader, epochs=1)


def main() -> None:
    global REF_MODEL
    r: dict = {"devices": int(os.environ["CPU_NUM_DEVICES"])}
    fabric = Fabric(accelerator="tpu", strategy="fsdp", devices="auto")  # the XLA plugin answers fsdp on XLA
    r["strategy"] = type(fabric.strategy).__name__
    r["world_size"] = fabric.world_size
    r["sampler_kwargs"] = fabric.strategy.distributed_sampler_kwargs
    r["ref_losses"], REF_MODEL, _ = c.reference()
    run(fabric, r, "")

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    wrapped = Fabric(accelerator="tpu", strategy=XLAFSDPStrategy(auto_wrap_policy=policy), devices=r["devices"])
    run(wrapped, r, "wrapped_")
    c.dump(c.out_dir() / f"spmd-{r['devices']}.json", r)


if __name__ == "__main__":
    main()
