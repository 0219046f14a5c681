"""The checkpoint contract, for every strategy that runs on the CPU: when ``fabric.save`` returns on every rank,
the checkpoint is at ``path`` and loads, without waiting for anything of ours; after ``handle.wait()`` and
``teardown()`` no thread of ours is left.

Each strategy saves three times in a row into the same path; right after each return every rank checks that the
path exists and reads the checkpoint with a reader that does not wait for our background work (``torch.load``
for a file, the format's one-process reader for a folder), expecting the step just saved.
"""

from __future__ import annotations

import textwrap

import pytest

from jobs import read_json, run_ranks

WORKER = textwrap.dedent(
    """
    import json, os, sys, threading
    from pathlib import Path
    import torch
    from fabric_core import Fabric

    out, kind, target = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if kind == "single":
        fabric = Fabric(accelerator="cpu", devices=1)
    elif kind == "ddp":
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    elif kind.startswith("fsdp"):
        from fabric_fsdp import FSDPStrategy
        fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(state_dict_type=kind.split("_")[1]), devices=2)
    elif kind == "deepspeed":
        from fabric_deepspeed import DeepSpeedStrategy
        fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=2)
    fabric.launch()

    def read_now(path):
        # Readers that know nothing of our background thread: what another program would see.
        if os.path.isfile(path):
            return torch.load(path, map_location="cpu", weights_only=True)["step"]
        if kind.startswith("fsdp"):
            from fabric_fsdp import load_sharded_checkpoint
            return load_sharded_checkpoint(path)["step"]
        from fabric_deepspeed import load_deepspeed_checkpoint
        return load_deepspeed_checkpoint(path)["step"]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    seen = []
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        handle = fabric.save(target, {"model": model, "optimizer": optimizer, "step": step})
        seen.append({"exists": os.path.exists(target), "step": read_now(target)})
    handle.wait()
    fresh = {"model": model, "optimizer": optimizer, "step": -1}
    fabric.load(target, fresh)
    fabric.barrier()
    fabric.strategy.teardown()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("fabric-checkpoint")]
    json.dump({"seen": seen, "loaded_step": fresh["step"], "threads": threads}, open(out / f"rank{fabric.global_rank}.json", "w"))
    """
)

CASES = {
    "single": 1,
    "ddp": 2,
    "fsdp_full": 2,
    "fsdp_sharded": 2,
    "deepspeed": 2,
}


@pytest.mark.parametrize("kind", list(CASES))
def test_the_checkpoint_is_at_path_when_save_returns_on_every_rank(kind, tmp_path):
    if kind.startswith("fsdp"):
        pytest.importorskip("fabric_fsdp")
    if kind == "deepspeed":
        pytest.importorskip("fabric_deepspeed")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    target = tmp_path / "ckpt" / "last.ckpt"
    world_size = CASES[kind]
    run_ranks(worker, str(tmp_path), kind, str(target), world_size=world_size, timeout=300, tmp_path=tmp_path)
    for rank in range(world_size):
        row = read_json(tmp_path / f"rank{rank}.json")
        assert row["seen"] == [{"exists": True, "step": s} for s in range(3)], (rank, row)
        assert row["loaded_step"] == 2 and row["threads"] == [], (rank, row)
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # nothing hidden left beside it
