"""Load the checkpoints written by train_checks.py on other layouts (argv: OUT MODE).

MODE ``fsdp1``   (1 rank):  FSDP loads the 2-rank sharded checkpoint and the full file, then saves ``sharded1/``.
MODE ``fsdp2``   (2 ranks): FSDP loads ``sharded1/`` (1 -> 2 ranks); DDP (if installed) loads the 2-rank sharded
                            checkpoint through the core's checkpoint-loader hook, saves a full file, and FSDP
                            loads that DDP file.
Every comparison is against ``full.ckpt`` (the exact FSDP weights and optimizer state at save time).
Results go to ``load_<MODE>.json``.
"""

from __future__ import annotations

import sys

import fsdp_common as c
import torch

from fabric_core import Fabric


def optimizer_diff(a: dict, b: dict) -> float:
    """Largest difference between two position-keyed optimizer state dicts (tensors and scalars)."""
    assert sorted(a["state"]) == sorted(b["state"]), (sorted(a["state"]), sorted(b["state"]))
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    diff = 0.0
    for k in a["state"]:
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            diff = max(diff, float((torch.as_tensor(v).float() - torch.as_tensor(w).float()).abs().max()))
    return diff


def fsdp_optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from fabric_fsdp.checkpoint import optimizer_state_by_position

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return optimizer_state_by_position(full)


def fresh_fsdp(fabric: Fabric, seed: int):
    model = fabric.setup_module(c.make_model(seed=seed))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    return model, optimizer


def main() -> None:
    out, mode = c.out_dir(), sys.argv[2]
    expected = torch.load(out / "full.ckpt", weights_only=True)
    expected_params = {k: v.float() for k, v in expected["model"].items()}
    result: dict = {}

    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=1 if mode == "fsdp1" else 2)
    fabric.launch()
    rank = fabric.global_rank
    c.mark(f"launched {mode}")

    if mode == "fsdp1":
        model, optimizer = fresh_fsdp(fabric, seed=3)
        # Gradients exist but the optimizer has no state yet: its state must still be restored.
        fabric.backward(model(torch.randn(2, c.D_IN, device=fabric.device)).sum())
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(out / "sharded", state)
        result["remainder"] = sorted(remainder)
        result["step"] = state["step"]
        result["param_diff"] = c.max_diff(c.full_params(model.module), expected_params)
        result["optimizer_diff"] = optimizer_diff(fsdp_optimizer_state(model.module, optimizer), expected["optimizer"])
        c.mark("loaded 2 -> 1")
        fabric.save(out / "sharded1", {"model": model, "optimizer": optimizer, "step": 11})
        model, optimizer = fresh_fsdp(fabric, seed=4)
        fabric.load(out / "full.ckpt", {"model": model, "optimizer": optimizer}, strict=False)
        result["full_param_diff"] = c.max_diff(c.full_params(model.module), expected_params)
        result["full_optimizer_diff"] = optimizer_diff(fsdp_optimizer_state(model.module, optimizer), expected["optimizer"])
        torch.save(expected["model"], out / "raw_model.pt")  # a plain PyTorch state dict, not saved by Fabric
        model = fabric.setup_module(c.make_model(seed=6))
        fabric.load_raw(out / "raw_model.pt", model)
        result["load_raw_param_diff"] = c.max_diff(c.full_params(model.module), expected_params)
    else:
        model, optimizer = fresh_fsdp(fabric, seed=3)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / "sharded1", state)
        result["step"] = state["step"]
        result["param_diff"] = c.max_diff(c.full_params(model.module), expected_params)
        result["optimizer_diff"] = optimizer_diff(fsdp_optimizer_state(model.module, optimizer), expected["optimizer"])
        c.mark("loaded 1 -> 2")
        try:
            import fabric_ddp  # noqa: F401
        except ImportError:
            result["ddp"] = "not installed"
        else:
            ddp = Fabric(accelerator="cpu", strategy="ddp", devices=2)
            ddp.launch()
            torch.manual_seed(0)
            plain = c.make_model(seed=8)
            plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-4)
            plain, plain_opt = ddp.setup(plain, plain_opt)
            ddp_state = {"model": plain, "optimizer": plain_opt, "step": 0}
            ddp.load(out / "sharded", ddp_state)
            result["ddp_step"] = ddp_state["step"]
            result["ddp_param_diff"] = c.max_diff(c.full_params(plain.module), expected_params)
            result["ddp_optimizer_diff"] = optimizer_diff(plain_opt.state_dict(), expected["optimizer"])
            c.mark("ddp loaded the sharded checkpoint")
            ddp.save(out / "ddp.ckpt", {"model": plain, "optimizer": plain_opt, "step": 12})
            model, optimizer = fresh_fsdp(fabric, seed=9)
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(out / "ddp.ckpt", state)
            result["from_ddp_step"] = state["step"]
            result["from_ddp_param_diff"] = c.max_diff(c.full_params(model.module), expected_params)
            result["from_ddp_optimizer_diff"] = optimizer_diff(
                fsdp_optimizer_state(model.module, optimizer), expected["optimizer"]
            )
            c.mark("fsdp loaded the ddp checkpoint")
    if rank == 0:
        c.dump(out / f"load_{mode}.json", result)
    fabric.barrier()


if __name__ == "__main__":
    main()
