"""A DeepSpeed checkpoint loads into other strategies (through the checkpoint-reader hook) and other world sizes.

``python load_elsewhere.py OUT two`` on 2 ranks: DDP, then FSDP, load ``ck_s3`` (saved by checkpoint_checks.py).
``python load_elsewhere.py OUT one`` on 1 rank: a single-device Fabric loads it; a 1-rank DeepSpeed engine loads
the 2-rank stage-3 checkpoint's weights (its optimizer state cannot follow into stage 2: a clear error), then
``resize_checks.py``'s shrink phase.
"""

from __future__ import annotations

import os
import sys

import ds_common as c
import resize_checks
import torch

from fabric_core import Fabric


def full(model) -> dict:
    inner = model.module if hasattr(model, "module") else model
    out = {}
    for k, v in inner.state_dict().items():
        v = v.detach()
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).float().cpu()
    return out


def main() -> None:
    out, mode = c.out_dir(), sys.argv[2]
    live = torch.load(out / "live_s3.pt", weights_only=True)
    result: dict = {}
    strategies = ["ddp", "fsdp"] if mode == "two" else ["single_device", "deepspeed_stage_2"]
    for name in strategies:
        c.mark(name)
        try:
            __import__({"ddp": "fabric_ddp", "fsdp": "fabric_fsdp"}.get(name, "fabric_core"))
        except ImportError:
            result[name] = "not installed"
            continue
        fabric = Fabric(accelerator="cpu", strategy=name, devices=2 if mode == "two" else 1)
        fabric.launch()
        model = c.make_model(99)
        model, optimizer = fabric.setup(model, c.make_optimizer(model))
        remainder = fabric.load(out / "ck_s3", {"model": model})
        result[name] = {"remainder": sorted(remainder), "diff": c.max_diff(full(model), live)}
        if name.startswith("deepspeed"):
            result["optimizer_error"] = c.expect_error(
                RuntimeError, "with ZeRO stage 3 into ZeRO stage 2", fabric.load, out / "ck_s3", {"model": model, "optimizer": optimizer}
            )
    if int(os.environ["RANK"]) == 0:
        c.dump(out / f"elsewhere_{mode}.json", result)
    if mode == "one":
        resize_checks.run_phase(out, "shrink")  # the 3-rank checkpoints of resize_checks.py grow, on 1 rank


if __name__ == "__main__":
    main()
