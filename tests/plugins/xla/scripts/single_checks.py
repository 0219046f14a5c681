"""One XLA device on the CPU PJRT device: ``python single_checks.py OUT`` writes ``OUT/single.json``.

Training through ``Fabric(accelerator="tpu")`` against eager CPU, the optimizer built before ``setup``, separate
``setup_module``/``setup_optimizers``, the device loader, clipping, ``no_backward_sync``, collectives, a save/load
round trip (CPU tensors on disk, training continues identically), and the precisions bf16-true/bf16-mixed.
"""

from __future__ import annotations

import warnings

import torch
import torch_xla
import xla_common as c

from fabric_core import Fabric


def main() -> None:
    out = c.out_dir()
    r: dict = {}
    fabric = Fabric(accelerator="tpu", devices=1)  # starts the XLA runtime before any CPU backward (pytorch/xla#4174)
    r["runtime_started_by_fabric"] = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    r["strategy"] = type(fabric.strategy).__name__
    r["precision"] = type(fabric.strategy.precision).__name__
    r["device"] = str(fabric.device)
    r["world_size"] = fabric.world_size

    ref_losses, ref_model, _ = c.reference()

    model = c.make_model()
    optimizer = c.make_optimizer(model)  # before setup: its parameter references must stay valid
    model, optimizer = fabric.setup(model, optimizer)
    params = list(model.parameters())
    r["optimizer_params_are_model_params"] = all(
        any(p is q for q in params) for g in optimizer.param_groups for p in g["params"]
    )
    r["params_on_xla"] = all(p.device.type == "xla" for p in params)
    loader = fabric.setup_dataloaders(c.dataloader())
    r["loader_len"] = len(loader)
    r["loader_batch_size"] = loader.batch_size
    first_x, _ = next(iter(loader))
    r["batch_device"] = str(first_x.device)

    r["losses"] = c.train(fabric, model, optimizer, loader)
    r["ref_losses"] = ref_losses
    r["param_diff"] = c.max_param_diff(model, ref_model)

    # no_backward_sync: a silent no-op (XLA reduces nothing in backward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fabric.no_backward_sync(model):
            x, y = next(iter(loader))
            fabric.backward(c.loss_fn(model(x), y))
    r["no_backward_sync_warnings"] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
    r["clip_norm_finite"] = bool(torch.isfinite(norm).item())
    optimizer.zero_grad()

    # collectives: one process, identities; only sum/mean
    t = torch.tensor([1.0, 5.0])
    r["all_reduce_sum"] = fabric.all_reduce(t, reduce_op="sum").cpu().tolist()
    r["all_reduce_mean"] = fabric.all_reduce(t).cpu().tolist()
    r["all_gather"] = fabric.all_gather(t).cpu().tolist()
    r["broadcast"] = fabric.broadcast({"a": 1})
    fabric.barrier()
    try:
        fabric.all_reduce(t, reduce_op="max")
        r["all_reduce_max"] = "accepted"
    except ValueError as err:
        r["all_reduce_max"] = str(err)

    # save / load round trip
    path = out / "single.ckpt"
    handle = fabric.save(path, {"model": model, "optimizer": optimizer, "step": 8})
    raw = torch.load(path, weights_only=True)  # at the path when save returns, before the handle's wait()
    handle.wait()
    r["checkpoint_all_cpu"] = c.all_cpu(raw)
    r["checkpoint_keys"] = sorted(raw)
    restored = c.make_model(seed=7)
    restored_optimizer = c.make_optimizer(restored)
    restored, restored_optimizer = fabric.setup(restored, restored_optimizer)
    remainder = fabric.load(path, {"model": restored, "optimizer": restored_optimizer})
    r["load_remainder"] = remainder
    r["restored_param_diff"] = c.max_param_diff(restored, model)
    r["restored_state_device"] = str(next(iter(restored_optimizer.optimizer.state.values()))["exp_avg"].device)
    # the checkpoint loads into a plain CPU model
    plain = c.make_model(seed=3)
    plain.load_state_dict(raw["model"])
    x, _ = next(iter(c.dataloader()))
    r["plain_model_matches"] = bool(torch.allclose(plain(x), model(x.to(fabric.device)).cpu(), atol=1e-5))
    # both continue with one more epoch and stay identical
    r["continued"] = c.train(fabric, model, optimizer, loader, epochs=1)
    r["restored_continued"] = c.train(fabric, restored, restored_optimizer, loader, epochs=1)

    # setup_module + setup_optimizers (an optimizer made after setup_module), and init_module
    separate = fabric.setup_module(c.make_model())
    separate_optimizer = fabric.setup_optimizers(c.make_optimizer(separate))
    r["separate_setup_losses"] = c.train(fabric, separate, separate_optimizer, loader, epochs=1)
    with fabric.init_module():
        built = torch.nn.Linear(4, 4)
    r["init_module_device"] = str(built.weight.device)

    # precisions, against float32 SGD on the CPU
    sgd_model = c.make_model()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=c.LR)
    r["sgd_ref_losses"] = []
    for _ in range(c.EPOCHS):
        for x, y in c.dataloader():
            sgd.zero_grad()
            loss = c.loss_fn(sgd_model(x), y)
            loss.backward()
            sgd.step()
            r["sgd_ref_losses"].append(loss.item())
    for name in ("bf16-true", "bf16-mixed"):
        pf = Fabric(accelerator="tpu", devices=1, precision=name)
        m = c.make_model()
        m, o = pf.setup(m, torch.optim.SGD(m.parameters(), lr=c.LR))
        pl = pf.setup_dataloaders(c.dataloader())
        x, _ = next(iter(pl))
        inner = []
        hook = m._forward_module[0].register_forward_hook(lambda mod, args, output, seen=inner: seen.append(str(output.dtype)))
        out_dtype = str(m(x).dtype)
        hook.remove()
        r[name] = {
            "precision": type(pf.strategy.precision).__name__ + ":" + pf.strategy.precision.precision,
            "param_dtype": str(next(m.parameters()).dtype),
            "output_dtype": out_dtype,
            "inner_dtype": inner[0],
            "losses": c.train(pf, m, o, pl),
        }
    c.dump(out / "single.json", r)


if __name__ == "__main__":
    main()
