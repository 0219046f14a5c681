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
    from fabric_core.io.location import CheckpointLocation

    out, kind, target = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if target.startswith("s3://"):
        import fsspec.config  # the S3 server's endpoint, as a user's fsspec configuration would hold it
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = os.environ["FSSPEC_S3_ENDPOINT_URL"]
    if kind == "single":
        fabric = Fabric(accelerator="cpu", devices=1)
    elif kind == "ddp":
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    elif kind.startswith("fsdp"):
        from fabric_fsdp import FSDPStrategy
        fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(state_dict_type=kind.split("_")[1]), devices=2)
    elif kind == "model_parallel":
        from fabric_fsdp import ModelParallelStrategy
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        def parallelize(model, mesh):  # Megatron-style: the first layer by columns, the last by rows
            return parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2)
        fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    elif kind.startswith("deepspeed"):
        from fabric_deepspeed import DeepSpeedStrategy
        fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2), devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()

    def read_now(path):
        # Readers that know nothing of our background thread: what another program would see.
        location = CheckpointLocation.of(path)
        if location.is_file():
            with location.open("rb") as file:
                return torch.load(file, map_location="cpu", weights_only=True)["step"]
        if kind.startswith("fsdp") or kind == "model_parallel":
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
        seen.append({"exists": CheckpointLocation.of(target).exists(), "step": read_now(target)})
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
    "model_parallel": 2,
    "deepspeed": 2,
}


def _plugin_of(kind):
    if kind.startswith("fsdp") or kind == "model_parallel":
        pytest.importorskip("fabric_fsdp")
    if kind.startswith("deepspeed"):
        pytest.importorskip("fabric_deepspeed")


def _run(kind, target, world_size, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    run_ranks(worker, str(tmp_path), kind, target, world_size=world_size, timeout=300, tmp_path=tmp_path)
    for rank in range(world_size):
        row = read_json(tmp_path / f"rank{rank}.json")
        assert row["seen"] == [{"exists": True, "step": s} for s in range(3)], (rank, row)
        assert row["loaded_step"] == 2 and row["threads"] == [], (rank, row)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(CASES))
def test_the_checkpoint_is_at_path_when_save_returns_on_every_rank(kind, tmp_path):
    _plugin_of(kind)
    target = tmp_path / "ckpt" / "last.ckpt"
    _run(kind, str(target), CASES[kind], tmp_path)
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # nothing hidden left beside it


@pytest.fixture
def s3_bucket(monkeypatch, request):
    """A fresh bucket on a server on loopback: ``(endpoint, bucket)``. Moto keeps its store per process, across
    servers, so every test gets a bucket of its own."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3_server

    server, endpoint = s3_server.start()
    bucket = "contract-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[-40:].strip("-")
    s3_server.create_bucket(endpoint, bucket)
    for key, value in s3_server.client_env(endpoint).items():
        monkeypatch.setenv(key, value)  # the rank processes inherit them
    try:
        yield endpoint, bucket
    finally:
        server.stop()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(CASES))
def test_every_strategy_saves_to_and_loads_from_an_s3_bucket(kind, tmp_path, s3_bucket):
    """The same contract at an S3 URL (a real S3-compatible server on loopback): what lands is in the bucket."""
    _plugin_of(kind)
    endpoint, bucket = s3_bucket
    _run(kind, f"s3://{bucket}/run/last.ckpt", CASES[kind], tmp_path)
    import boto3
    from s3_server import CREDENTIALS

    client = boto3.client("s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                          aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys and all(k.startswith("run/last.ckpt") for k in keys), keys
    assert not any(p.name.startswith("s3:") for p in tmp_path.iterdir())  # no local folder named after the URL


@pytest.mark.multiprocess
def test_deepspeed_saves_to_and_loads_from_memory_urls(tmp_path):
    """fsspec's in-process store, with one process (``memory://`` is not shared between processes)."""
    _plugin_of("deepspeed")
    _run("deepspeed_1", "memory://contract/last.ckpt", 1, tmp_path)
    assert not any(p.name.startswith("memory:") for p in tmp_path.iterdir())
