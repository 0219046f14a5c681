"""FSDP checkpoints on a remote store and asynchronous sharded saves; run by ``test_fsdp_storage.py`` on 2 ranks.

    python storage_checks.py OUTDIR URL      # URL: s3://bucket/prefix on the test's S3 server (FSSPEC_S3_ENDPOINT_URL)

Checks (each rank asserts; rank 0 writes OUTDIR/result.json):
* sharded save to the URL, then load into a fresh FSDP model: bit-exact, and the training continues identically;
* full save to the URL and load back;
* a second sharded save to the same URL replaces the first (the marker names the new version, one version left);
* async sharded save to a local path: returns before the write finishes, the model may change right after, and
  what is loaded is the state at the time of the call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fabric_core import Fabric
from fabric_fsdp import FSDPStrategy


def build(fabric: Fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def step(fabric: Fabric, model, optimizer) -> float:
    torch.manual_seed(100 + fabric.global_rank)
    loss = model(torch.randn(8, 16)).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(fabric.all_reduce(loss.detach()))


def full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(out: Path, url: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    result: dict[str, object] = {}
    model, optimizer = build(fabric, 0)
    step(fabric, model, optimizer)

    fabric.save(url + "/sharded", {"model": model, "optimizer": optimizer, "step": 1})
    expected = step(fabric, model, optimizer)
    reloaded, reopt = build(fabric, 1)
    assert fabric.load(url + "/sharded", {"model": reloaded, "optimizer": reopt})["step"] == 1
    result["sharded_continues"] = step(fabric, reloaded, reopt) == expected

    fabric.save(url + "/sharded", {"model": model, "optimizer": optimizer, "step": 2})
    if fabric.is_global_zero:
        from fabric_core.io import remote

        fs, inner = remote.filesystem(url + "/sharded")
        result["versions_left"] = sorted(p.rpartition("/")[2] for p in fs.ls(inner, detail=False))
    state = {"model": reloaded, "optimizer": reopt, "step": 0}
    fabric.load(url + "/sharded", state)
    result["second_save_wins"] = state["step"] == 2

    full_fabric_strategy = FSDPStrategy(state_dict_type="full")
    assert full_fabric_strategy.state_dict_type == "full"
    fabric.strategy.state_dict_type = "full"
    fabric.save(url + "/full.ckpt", {"model": model, "step": 3})
    fabric.strategy.state_dict_type = "sharded"
    probe, _ = build(fabric, 2)
    assert fabric.load(url + "/full.ckpt", {"model": probe})["step"] == 3
    result["full_round_trip"] = all(torch.equal(a, b) for a, b in zip(full(probe).values(), full(model).values()))

    before = full(model)
    handle = fabric.save(out / "async-ckpt", {"model": model, "optimizer": optimizer, "step": 4}, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)  # training goes on: the checkpoint must hold the values from before
    handle.wait()
    target, target_opt = build(fabric, 3)
    assert fabric.load(out / "async-ckpt", {"model": target, "optimizer": target_opt})["step"] == 4
    result["async_snapshot"] = all(torch.equal(a, b) for a, b in zip(full(target).values(), before.values()))
    result["async_no_temp"] = not [p.name for p in out.iterdir() if p.name.startswith(".async-ckpt")]

    # asynchronous sharded save to the object store: a new version committed by its marker in the background
    fabric.save(url + "/async-remote", {"model": target, "optimizer": target_opt, "step": 5}, async_save=True).wait()
    before = full(target)
    handle = fabric.save(url + "/async-remote", {"model": target, "optimizer": target_opt, "step": 6}, async_save=True)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1000.0)
    handle.wait()
    remote_target, remote_opt = build(fabric, 4)
    assert fabric.load(url + "/async-remote", {"model": remote_target, "optimizer": remote_opt})["step"] == 6
    result["async_remote_snapshot"] = all(torch.equal(a, b) for a, b in zip(full(remote_target).values(), before.values()))
    if fabric.is_global_zero:
        from fabric_core.io import remote

        fs, inner = remote.filesystem(url + "/async-remote")
        result["async_remote_left"] = sorted(p.rpartition("/")[2] for p in fs.ls(inner, detail=False))
    if fabric.is_global_zero:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
