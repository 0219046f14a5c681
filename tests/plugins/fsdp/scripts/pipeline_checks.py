"""Run as 2 ranks (pipeline 2) or 4 ranks (pipeline 2 x data parallel 2): ``model_parallel``'s pipeline axis end to end.

2 ranks: one step of every schedule (GPipe and 1F1B split by module names, 1F1B split by a function, Interleaved1F1B
and LoopedBFS with 2 stages per rank) against one process running the whole model on the same batch (loss and every
gradient), a second step after AdamW and clipping over both stages, a sharded checkpoint loaded back into
data parallel 2 x pipeline 1 on the same processes (and, by the test, into one process), and the errors that need a
running pipeline. 4 ranks: 1F1B with FSDP2 over the data-parallel rows of each stage, against one process on the
global batch. Then, in the same job, the sequence axis's checks (``sequence_checks.py``: sequence parallel 2, and
data parallel 2 x sequence parallel 2 on 4 ranks). Writes ``result.json`` (rank 0) for
tests/plugins/fsdp/test_pipeline_sequence.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, out_dir  # noqa: E402

from fabric_core import Fabric  # noqa: E402
from fabric_fsdp import ModelParallelStrategy  # noqa: E402

D_IN, D, D_OUT, LAYERS, BATCH = 6, 8, 3, 4, 8
LR, MAX_NORM = 1e-2, 0.05


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """A chain: input layer, blocks, norm, head (what a split by names needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class NotAChain(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * 2.0  # computed between two pieces: a stage split by names would not do it
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def split_in_two(model: Net, stage: int, num_stages: int) -> nn.Module:
    """A split by function: nn.Sequential stages over the model's own modules."""
    assert num_stages == 2
    if stage == 0:
        return nn.Sequential(model.inp, *model.layers[:2])
    return nn.Sequential(*model.layers[2:], model.norm, model.head)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(seed: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, D_IN, generator=g), torch.randn(size, D_OUT, generator=g)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grads_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest difference between this rank's gradients (by full name) and the one-process model's."""
    ref = dict(reference.named_parameters())
    diffs = [float((local_tensor(p.grad) - ref[n].grad).abs().max()) for n, p in model.module.named_parameters()]
    assert diffs, "no local parameters"
    return max(diffs)


def worst(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def fsdp_rows(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(model, "layers", []):
        if isinstance(layer, Block):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def schedule_checks(world: int, result: dict) -> None:
    """Every schedule on 2 pipeline ranks: step, AdamW + clipping, a second step; against one process."""
    runs = {
        "GPipe": dict(pipeline_schedule="GPipe", pipeline_split=["layers.2"], pipeline_micro_batches=4),
        "1F1B": dict(pipeline_schedule="1F1B", pipeline_split=["layers.2"], pipeline_micro_batches=4),
        "1F1B_function": dict(pipeline_schedule="1F1B", pipeline_split=split_in_two, pipeline_micro_batches=2),
        "Interleaved1F1B": dict(pipeline_schedule="Interleaved1F1B", pipeline_split=["layers.1", "layers.2", "layers.3"]),
        "LoopedBFS": dict(pipeline_schedule="LoopedBFS", pipeline_split=["layers.1", "layers.2", "layers.3"], pipeline_micro_batches=2),
    }
    for name, options in runs.items():
        fabric = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(pipeline_parallel_size=2, **options))
        fabric.launch()
        torch.manual_seed(0)
        model, reference = Net(), Net()
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # over the whole model: keeps this rank's part
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
        model, optimizer = fabric.setup(model, optimizer)
        own = {n for n, _ in model.module.named_parameters()}
        result.setdefault("held", {})[name] = sorted(own)
        result.setdefault("optimizer_holds_own", {})[name] = len(optimizer.param_groups[0]["params"]) == len(own)
        record = result.setdefault("schedules", {})[name] = {"loss": [], "ref_loss": [], "grad_diff": [], "norms": []}
        for step in range(2):
            x, y = batch(step)
            loss = fabric.forward_backward(model, x, target=y, loss_fn=loss_fn)
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            record["loss"].append(float(loss))
            record["ref_loss"].append(float(ref_loss))
            record["grad_diff"].append(worst(grads_diff(model, reference)))
            norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            record["norms"].append([float(norm), float(ref_norm)])
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        ref = dict(reference.named_parameters())
        record["param_diff"] = worst(max(float((p - ref[n]).abs().max()) for n, p in model.module.named_parameters()))
        losses = [torch.tensor(record["loss"])]
        record["same_loss_on_every_rank"] = bool(torch.equal(fabric.all_gather(losses[0])[0], fabric.all_gather(losses[0])[-1]))
        mark(f"schedule {name}")
        if name == "1F1B":
            checkpoint_checks(fabric, model, optimizer, world, result)


def checkpoint_checks(fabric: Fabric, model: nn.Module, optimizer, world: int, result: dict) -> None:
    """Save the pipeline-2 model sharded; load it into data parallel 2 x pipeline 1 on the same two processes."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = out_dir()
    fabric.save(out / "pipeline_ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    rank = fabric.global_rank
    own_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    own_optimizer = get_optimizer_state_dict(fabric.strategy.unwrap_module(model.module), optimizer.optimizer)["state"]
    torch.save({"model": own_model, "optimizer": own_optimizer}, out / f"expected_rank{rank}.pt")
    fabric.barrier()
    expected_model: dict = {}
    expected_optimizer: dict = {}
    for r in range(world):
        part = torch.load(out / f"expected_rank{r}.pt", weights_only=True)
        expected_model.update(part["model"])
        expected_optimizer.update(part["optimizer"])
    result["checkpoint_keys"] = sorted(expected_model)

    # pipeline 1 x data parallel 2 (FSDP2 over both processes): every tensor back exactly, optimizer state too
    other = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(fsdp_rows, data_parallel_size=world))
    other.launch()
    into = other.setup_module(Net())
    into_optimizer = other.setup_optimizers(torch.optim.AdamW(into.parameters(), lr=LR))
    remainder = other.load(out / "pipeline_ckpt", {"model": into, "optimizer": into_optimizer})
    loaded = {k: local_tensor(v) for k, v in into.state_dict().items()}
    result["dp2_remainder"] = remainder
    result["dp2_loads_exactly"] = worst(float(not all(torch.equal(loaded[k], v) for k, v in expected_model.items()))) == 0
    state = get_optimizer_state_dict(other.strategy.unwrap_module(into.module), into_optimizer.optimizer)["state"]
    result["dp2_optimizer_exactly"] = all(
        torch.equal(local_tensor(state[k][s]), v) for k, entry in expected_optimizer.items() for s, v in entry.items()
    )
    mark("checkpoint into pipeline 1 x data parallel 2")


def error_checks(world: int, result: dict) -> None:
    fabric = Fabric(
        accelerator="cpu", devices=world,
        strategy=ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["layers.2"], pipeline_micro_batches=4),
    )  # fmt: skip
    fabric.launch()
    model = fabric.setup_module(NotAChain())
    x, y = batch(0)
    result["chain_error"] = expect_error(ValueError, "not the chain of its pieces", fabric.forward_backward, model, x, target=y, loss_fn=loss_fn)
    torch.manual_seed(1)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    model = fabric.setup_module(model)
    result["direct_call_error"] = expect_error(TypeError, "fabric.forward_backward", model, x)
    x, y = batch(0, size=6)
    result["uneven_error"] = expect_error(ValueError, "micro_batches=4", fabric.forward_backward, model, x, target=y, loss_fn=loss_fn)
    result["few_micro_batches_error"] = expect_error(
        ValueError, "at least as many micro-batches", fabric.forward_backward, model, x, target=y, loss_fn=loss_fn, micro_batches=1
    )
    result["no_target_error"] = expect_error(TypeError, "needs `target=`", fabric.forward_backward, model, x, loss_fn=loss_fn)
    # a smaller last batch builds a new schedule for its shapes
    x, y = batch(5, size=4)
    result["smaller_batch_loss"] = float(fabric.forward_backward(model, x, target=y, loss_fn=loss_fn))
    result["smaller_batch_ref_loss"] = float(loss_fn(reference(x), y))
    mark("errors")


def data_parallel_checks(world: int, result: dict) -> None:
    """Pipeline 2 x data parallel 2: FSDP2 over each stage's rows; against one process on the global batch."""
    strategy = ModelParallelStrategy(
        fsdp_rows, data_parallel_size=2, pipeline_parallel_size=2, pipeline_split=["layers.2"], pipeline_micro_batches=2
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    result["pipeline_coordinates"] = fabric.all_gather(torch.tensor(list(strategy.coordinates().values()))).tolist()
    topology = fabric.topology
    result["pipeline_axes"] = [[a.name, a.size, a.role] for a in topology.axes]
    result["pipeline_data_parallel"] = [topology.data_parallel_size, topology.data_parallel_rank, strategy.data_parallel_rank]
    result["pipeline_sampler"] = [strategy.distributed_sampler_kwargs["num_replicas"], strategy.distributed_sampler_kwargs["rank"]]
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    row = strategy.data_parallel_rank
    record = result["pp2_dp2"] = {"loss": [], "ref_loss": [], "grad_diff": []}
    for step in range(2):
        x, y = batch(10 * step + row)
        rows = [batch(10 * step + r) for r in range(2)]
        loss = fabric.forward_backward(model, x, target=y, loss_fn=loss_fn)
        loss = fabric.all_reduce(loss, reduce_op="mean")
        ref_loss = loss_fn(reference(torch.cat([r[0] for r in rows])), torch.cat([r[1] for r in rows]))
        ref_loss.backward()
        record["loss"].append(float(loss))
        record["ref_loss"].append(float(ref_loss))
        record["grad_diff"].append(worst(grads_diff(model, reference)))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    ref = dict(reference.named_parameters())
    record["param_diff"] = worst(max(float((local_tensor(p) - ref[n]).abs().max()) for n, p in model.module.named_parameters()))
    record["sharded"] = all(hasattr(p, "device_mesh") for p in model.parameters())
    mark("pipeline 2 x data parallel 2")


def main() -> None:
    # This folder: the sequence axis's checks, in the same job. Every Fabric of the job shares one process group,
    # which the last one's teardown ends (a new group after a teardown could hang while the earlier meshes' groups
    # are not yet garbage: see the closing notes of issue 42).
    from sequence_checks import sequence_checks

    world = int(sys.argv[2])
    result: dict = {"world": world}
    if world == 2:
        schedule_checks(world, result)
        error_checks(world, result)
    else:
        data_parallel_checks(world, result)
    sequence_checks(world, result)
    if os.environ["RANK"] == "0":
        dump(out_dir() / "result.json", result)
    mark("done")


if __name__ == "__main__":
    main()
