"""Run as 2 ranks: what the core's defaults do for a strategy that shards parameters (tp_strategy.py).

Joint setup with an optimizer created before (rewired to the DTensor parameters), a few steps with clipping against
a one-process reference on the same batches, the sampler giving tensor-parallel peers the same batches, separate
setup, and the refusal of a sharding strategy that does not declare its data-parallel layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, out_dir  # noqa: E402
from tp_strategy import D_IN, D_OUT, TensorParallelStrategy, UndeclaredTensorParallelStrategy, make_model  # noqa: E402

from fabric_core import Fabric  # noqa: E402
from fabric_core.utilities.dtensor import is_dtensor  # noqa: E402

STEPS, MAX_NORM = 4, 0.5


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if is_dtensor(v) else v).detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    result: dict = {}
    fabric = Fabric(accelerator="cpu", strategy=TensorParallelStrategy(), devices=2)
    fabric.launch()
    fabric.seed_everything(7)
    result["world"] = fabric.world_size

    # Joint setup: the optimizer exists before the strategy replaces the parameters.
    model = make_model()
    reference = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    model, optimizer = fabric.setup(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    module_params = list(model.parameters())
    result["optimizer_params_are_dtensors"] = all(is_dtensor(p) for p in params)
    result["optimizer_params_are_model_params"] = [id(p) for p in params] == [id(p) for p in module_params]

    # Data: 16 samples, shuffled; both tensor-parallel peers must read the same ones.
    data = TensorDataset(torch.randn(16, D_IN), torch.randn(16, D_OUT))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    result["sampler_replicas"] = loader.sampler.num_replicas if hasattr(loader.sampler, "num_replicas") else None
    same_batches, losses, ref_losses, norms, ref_norms, norm_types = [], [], [], [], [], set()
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        gathered = fabric.all_gather(x)
        same_batches.append(bool(torch.equal(gathered[0], gathered[1])))
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        norm_types.add(type(norm).__name__)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
        norms.append(float(norm))
    result.update(same_batches=same_batches, losses=losses, ref_losses=ref_losses, norms=norms, ref_norms=ref_norms)
    result["norm_types"] = sorted(norm_types)
    trained, expected = full(model), reference.state_dict()
    result["param_diff"] = max(float((trained[k] - expected[k]).abs().max()) for k in expected)
    result["trained"] = float((trained["0.weight"] - make_model().state_dict()["0.weight"]).abs().max()) > 0
    mark("joint setup trained")

    # Separate setup, with an optimizer created before `setup_module` (the reference's order is the other one).
    second = make_model(1)
    early = torch.optim.AdamW(second.parameters(), lr=1e-3)
    second = fabric.setup_module(second)
    early = fabric.setup_optimizers(early)
    result["separate_rewired"] = [id(p) for g in early.param_groups for p in g["params"]] == [id(p) for p in second.parameters()]

    # The default checkpoint (one file from rank 0) of DTensor state: whole tensors in the file, each rank's part back.
    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(5))
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    step(second, early)
    path = out_dir() / "default.ckpt"
    fabric.save(path, {"model": second, "optimizer": early, "step": 1})
    third = fabric.setup_module(make_model(2))
    third_optimizer = fabric.setup_optimizers(torch.optim.AdamW(third.parameters(), lr=1e-3))
    remainder = fabric.load(path, {"model": third, "optimizer": third_optimizer})
    result["load_remainder"] = remainder
    local = lambda m: {k: v.to_local() for k, v in m.state_dict().items()}  # noqa: E731
    result["loaded_shards_equal"] = all(torch.equal(a, b) for a, b in zip(local(second).values(), local(third).values()))
    file = torch.load(path, weights_only=True)
    result["file_is_whole"] = all(not is_dtensor(v) for v in file["model"].values()) and all(
        torch.equal(file["model"][k], v) for k, v in full(second).items()
    )
    step(second, early)
    step(third, third_optimizer)
    result["resumed_bit_exact"] = all(torch.equal(a, b) for a, b in zip(local(second).values(), local(third).values()))
    mark("default checkpoint")

    # A sharding strategy that does not say which processes share data is refused at setup.
    undeclared = Fabric(accelerator="cpu", strategy=UndeclaredTensorParallelStrategy(), devices=2)
    undeclared.launch()
    result["undeclared_error"] = expect_error(ValueError, "data_parallel_rank", undeclared.setup, make_model())
    if fabric.global_rank == 0:
        dump(out_dir() / "result.json", result)
    mark("done")


if __name__ == "__main__":
    main()
