"""A Ray driver the tests run as a job: Fabric training loops inside ``TorchTrainer`` on the cluster at RAY_ADDRESS.

``python ray_job.py SCENARIO OUT [ARGS ...]``; every worker writes what it saw to ``OUT`` as JSON, the driver
prints one ``RESULT {...}`` line per fit. Scenarios:

* ``ranks STRATEGY:LAYOUT...``: 2 workers (``model_parallel`` as ``ModelParallelStrategy(parallelize_fn)``), one per node (``spread``: ``STRICT_SPREAD``, ``Fabric(devices=1,
  num_nodes=2)``) or both on one node (``pack``: ``PACK``, ``Fabric(devices=2)``); a few steps, then each worker records
  Ray's and Fabric's ranks, whether Fabric used Ray's process group, and saves the whole model's weights as that rank
  holds them (sharded ones gathered) to ``OUT/NAME-rankR.pt``, for the test to compare with one process.
* ``mismatch``: ``Fabric(devices=4)`` under ``ScalingConfig(num_workers=2)``.
* ``too_many``: ``ScalingConfig(num_workers=6)`` on the tests' cluster of 4 CPUs, with the recipe of
  plugins/ray/README.md for a cluster of fixed size: ``FailureConfig(controller_failure_limit=0)`` and a short
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (here 5 s, through the job's ``runtime_env``). Without them Ray 2.60
  waits 60 s and retries without end.
* ``elastic PAUSE``: ``ScalingConfig(num_workers=(1, 2))`` with one worker per node and
  ``FailureConfig(max_failures=3)``: the ``slow`` run of ``tests/plugins/scripts/elastic_train.py`` (``loggers="ray"``),
  which the test shrinks and grows by removing and adding the second node.
* ``resume NAME``: 20 steps with ``loggers="ray"``, a checkpoint every 5 steps, ``FailureConfig(max_failures=1)``;
  rank 1 writes its pid and step to ``OUT/progress`` (the test may SIGKILL it). A restarted worker first empties
  its node's checkpoint folder, as on a fresh machine, so it can only resume from Ray's storage.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import ray
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def ranks_loop(config: dict) -> None:
    import torch.distributed as dist

    from fabric_core import Fabric

    ray_group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    context = ray.train.get_context()
    strategy = config["strategy"]
    if strategy == "model_parallel":  # as a user passes it: the strategy object with their parallelize_fn
        from fabric_fsdp import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=_shard_over_data_parallel)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=config["devices"], num_nodes=config["num_nodes"])
    fabric.launch()  # starts nothing under Ray Train
    net = _model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = fabric.setup(net, optimizer)
    for step in range(3):
        x, y = _batch(step, fabric.global_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    torch.save(_full_weights(net), Path(config["out"]) / f"{config['name']}-rank{fabric.global_rank}.pt")
    record = {
        "environment": type(fabric._strategy.cluster_environment).__name__,
        "launcher": type(fabric._strategy.launcher).__name__ if fabric._strategy.launcher is not None else None,
        "fabric": [fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size],
        "ray": [context.get_world_rank(), context.get_local_rank(), context.get_node_rank(), context.get_world_size()],
        "ray_made_group": ray_group is not None,
        "same_group": ray_group is dist.distributed_c10d._get_default_group(),
        "backend": dist.get_backend(),
        "children": len(_children()),
        "pid": os.getpid(),
    }
    fabric.teardown()
    record["group_alive_after_teardown"] = dist.is_initialized()
    out = Path(config["out"]) / f"{config['name']}-rank{fabric.global_rank}.json"
    out.write_text(json.dumps(record))


def _shard_over_data_parallel(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    """``parallelize_fn`` of the model_parallel run: FSDP2 over the mesh's data-parallel rows (one per node)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def reference_weights(world_size: int = 2, steps: int = 3) -> dict[str, torch.Tensor]:
    """What every rank of ``ranks_loop`` must end with: one process, plain torch, training on all ranks' batches at
    once (the mean loss over equal batches has the ranks' averaged gradient)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batches = [_batch(step, rank) for rank in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the whole model as this rank holds it: a replicated one (DDP, DeepSpeed ZeRO-2) as it is, a
    sharded one (an FSDP2 DTensor) gathered (collective: every rank calls it, in the same order). No reduction across
    ranks, so a rank whose weights went astray shows."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in model.named_parameters()
    }


def _children() -> list[int]:
    """Live child processes of this worker (``fabric.launch()`` must not start any)."""
    try:
        text = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def mismatch_loop(config: dict) -> None:
    from fabric_core import Fabric

    Fabric(accelerator="cpu", strategy="ddp", devices=4, num_nodes=1)


def resume_loop(config: dict) -> None:
    import torch.distributed as dist

    from fabric_core import Fabric

    ckpts = Path(config["ckpts"])
    restarted = ray.train.get_checkpoint() is not None
    if restarted and ray.train.get_context().get_local_rank() == 0:
        shutil.rmtree(ckpts, ignore_errors=True)  # a restarted worker on a fresh machine: nothing local survives
    dist.barrier()  # Ray's group, made before this function
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, loggers="ray")
    fabric.launch()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    latest = fabric.latest_checkpoint(str(ckpts / "step-*.ckpt"))
    if latest is not None:
        fabric.load(latest, state)
        fabric.print(f"RESUMED {Path(latest).name} step {state['step']} restored={fabric.logger.restored}")
    while state["step"] < 20:
        x, y = _batch(state["step"], fabric.global_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.log_dict({"loss": loss.item()}, step=state["step"])
        if state["step"] % 5 == 0:
            fabric.save(ckpts / f"step-{state['step']:04d}.ckpt", state)
        if fabric.global_rank == 1 and not restarted:
            (Path(config["out"]) / "progress").write_text(f"{os.getpid()} {state['step']}")
            time.sleep(0.2)  # room for the test's SIGKILL mid-run
    if fabric.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, config["weights"])


def elastic_loop(config: dict) -> None:
    """The elastic run of ``tests/plugins/scripts/elastic_train.py`` (its ``slow`` run) inside a Ray Train worker, with
    ``loggers="ray"``: every checkpoint is reported to Ray, and a restarted worker group resumes from it."""
    sys.path.insert(0, config["scripts"])
    import elastic_train

    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", precision="64-true", loggers="ray")
    fabric.launch()  # starts nothing under Ray Train
    elastic_train.train(fabric, Path(config["out"]) / "slow", "kept", pause=config["pause"])


def fit(loop, config: dict, scaling: ScalingConfig, run: RunConfig | None = None) -> object:
    trainer = TorchTrainer(loop, train_loop_config=config, scaling_config=scaling, run_config=run or RunConfig(storage_path=config["out"], name=config["name"]))
    return trainer.fit()


def main() -> int:
    scenario, out, *args = sys.argv[1:]
    out = str(Path(out).absolute())
    start_timeout = {"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}} if scenario == "too_many" else None
    ray.init(logging_level="ERROR", _node_ip_address=os.environ.get("TEST_RAY_NODE_IP"), runtime_env=start_timeout)
    if scenario == "ranks":
        layouts = {"spread": (1, 2, "STRICT_SPREAD"), "pack": (2, 1, "PACK")}
        for run in args:
            strategy, layout = run.split(":")
            devices, nodes, placement = layouts[layout]
            config = {"strategy": strategy, "devices": devices, "num_nodes": nodes, "out": out, "name": f"{strategy}-{layout}"}
            fit(ranks_loop, config, ScalingConfig(num_workers=2, placement_strategy=placement))
            print("RESULT", json.dumps({"name": config["name"]}), flush=True)
    elif scenario in ("mismatch", "too_many"):
        config = {"out": out, "name": scenario}
        workers = 2 if scenario == "mismatch" else 6
        fail_fast = RunConfig(storage_path=out, name=scenario, failure_config=FailureConfig(controller_failure_limit=0))
        try:
            fit(mismatch_loop, config, ScalingConfig(num_workers=workers), fail_fast if scenario == "too_many" else None)
        except Exception as err:
            print("FAILED", type(err).__name__, err, flush=True)
            return 3
    elif scenario == "elastic":
        # one worker per node (each takes both CPUs of its node): 1 or 2 workers, as many as the cluster has nodes
        config = {"out": out, "scripts": str(Path(__file__).parents[1] / "scripts"), "pause": float(args[0])}
        scaling = ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 2}, elastic_resize_monitor_interval_s=2.0)
        run = RunConfig(
            storage_path=str(Path(out) / "storage"),
            name="elastic",
            failure_config=FailureConfig(max_failures=3),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        )
        result = fit(elastic_loop, config, scaling, run)
        print("RESULT", json.dumps({"checkpoint": result.checkpoint.path if result.checkpoint else None}), flush=True)
    elif scenario == "resume":
        name = args[0]
        config = {"out": out, "name": name, "ckpts": str(Path(out) / f"{name}-local"), "weights": str(Path(out) / f"{name}.pt")}
        run = RunConfig(
            storage_path=str(Path(out) / "storage"),
            name=name,
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        )
        result = fit(resume_loop, config, ScalingConfig(num_workers=2), run)
        print("RESULT", json.dumps({"metrics": result.metrics, "checkpoint": result.checkpoint.path if result.checkpoint else None}), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
