"""Run as 2 ranks (tensor parallel 2, sizes "auto") or 4 ranks (data parallel 2 x tensor parallel 2, "2x2"):
``model_parallel`` end to end.

Training with gradient accumulation (``no_backward_sync``) and clipping against one process on the global batch,
the sampler's rows, meta-device init, sharded and full checkpoints (bit-exact resume, loaded into ``fsdp``), and the
arguments' errors. Writes ``result.json`` (rank 0) for tests/plugins/fsdp/test_model_parallel.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the shared script helpers
from script_helpers import dump, expect_error, mark, out_dir  # noqa: E402

from fabric_core import Fabric  # noqa: E402
from fabric_fsdp import FSDPStrategy, ModelParallelStrategy  # noqa: E402

D_IN, D, D_OUT, BATCH, STEPS, MAX_NORM = 8, 16, 4, 4, 3, 0.5
SEEN_MESHES: list = []


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_IN, D)
        self.down = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(x)))
        return self.head(self.norm(h))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Megatron-style tensor parallelism on ``up``/``down``, then FSDP2 over the data-parallel rows."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    SEEN_MESHES.append((tuple(mesh.mesh_dim_names), tuple(mesh.shape)))
    parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    world, shape = int(sys.argv[2]), sys.argv[3]  # shape: "auto" or "DPxTP"
    result: dict = {}
    sizes = {} if shape == "auto" else dict(zip(("data_parallel_size", "tensor_parallel_size"), map(int, shape.split("x"))))
    strategy = ModelParallelStrategy(parallelize, **sizes)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=world)
    fabric.launch()
    dp, tp = strategy.data_parallel_size, strategy.tensor_parallel_size
    result.update(world=fabric.world_size, dp=dp, tp=tp)

    # --- training: two micro-batches per step, the first under no_backward_sync, clipped; against one process
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created before setup: rewired to the shards
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    result["meshes"] = SEEN_MESHES[:1]
    data = TensorDataset(torch.randn(64, D_IN), torch.randn(64, D_OUT))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    result["sampler"] = [loader.sampler.num_replicas, loader.sampler.rank]
    batches = iter(loader)
    losses, ref_losses, norms, ref_norms, types, peers_same = [], [], [], [], set(), []
    for _ in range(STEPS):
        for micro in range(2):
            x, y = next(batches)
            gathered = fabric.all_gather(torch.cat([x, y], 1))  # (world, BATCH, D_IN + D_OUT)
            rows = [gathered[row * tp] for row in range(dp)]  # each row's batch, once
            peers_same.append(all(torch.equal(gathered[r], gathered[(r // tp) * tp]) for r in range(world)))
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = nn.functional.mse_loss(model(x), y) / 2
                fabric.backward(loss)
            glob = torch.cat(rows)
            ref_loss = nn.functional.mse_loss(reference(glob[:, :D_IN]), glob[:, D_IN:]) / 2
            ref_loss.backward()
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        types.add(type(norm).__name__)
        norms.append(float(norm))
        ref_norms.append(float(nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        ref_losses.append(float(ref_loss))
    result.update(losses=losses, ref_losses=ref_losses, norms=norms, ref_norms=ref_norms, norm_types=sorted(types))
    result["peers_same_batches"] = all(peers_same)
    result["param_diff"] = max(float((v - reference.state_dict()[k]).abs().max()) for k, v in full(model).items())
    mark("trained")

    # --- meta-device init: only local shards allocated; tensor-parallel replicas of a parameter agree
    with fabric.init_module(empty_init=True):
        meta_model = Net()
    result["built_on_meta"] = all(p.is_meta for p in meta_model.parameters())
    meta_model = fabric.setup_module(meta_model)
    bias = meta_model.down.bias.to_local()  # RowwiseParallel: replicated over the tensor-parallel ranks
    gathered_bias = fabric.all_gather(bias)
    result["replicated_bias_agrees"] = all(torch.equal(gathered_bias[(r // tp) * tp], gathered_bias[r]) for r in range(world))
    result["materialized_finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in meta_model.parameters())

    # --- sharded checkpoint: resume bit-exactly (model, optimizer), fresh model built on the meta device
    out = out_dir()
    fabric.save(out / "sharded", {"model": model, "optimizer": optimizer, "step": STEPS})
    saved = {"sharded": full(model)}
    if fabric.global_rank == 0:
        torch.save(saved["sharded"], out / "sharded_expected.pt")
    with fabric.init_module(empty_init=True):
        resumed = Net()
    resumed = fabric.setup_module(resumed)
    resumed_optimizer = fabric.setup_optimizers(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    remainder = fabric.load(out / "sharded", {"model": resumed, "optimizer": resumed_optimizer})
    result["sharded_remainder"] = remainder
    result["sharded_loaded_equal"] = same(local(model), local(resumed))
    x, y = torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(fabric.global_rank // tp)), torch.zeros(BATCH, D_OUT)
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        fabric.backward(nn.functional.mse_loss(m(x), y))
        o.step()
        o.zero_grad()
    result["sharded_resume_bit_exact"] = same(local(model), local(resumed))
    mark("sharded checkpoint")

    # --- full checkpoint (one file from rank 0), loaded back into a model_parallel model
    strategy.state_dict_type = "full"
    fabric.save(out / "full.ckpt", {"model": model, "optimizer": optimizer})
    strategy.state_dict_type = "sharded"
    from_full = fabric.setup_module(Net())
    full_optimizer = fabric.setup_optimizers(torch.optim.AdamW(from_full.parameters(), lr=1e-2))
    fabric.load(out / "full.ckpt", {"model": from_full, "optimizer": full_optimizer})
    result["full_loaded_equal"] = same(local(model), local(from_full))
    expected_full = saved["full.ckpt"] = full(model)
    if fabric.global_rank == 0:
        file = torch.load(out / "full.ckpt", weights_only=True)
        result["full_file_is_whole"] = same(file["model"], expected_full)

    # --- both layouts load into `fsdp` (a plain model sharded by FSDP2 over every rank)
    fsdp = Fabric(accelerator="cpu", strategy=FSDPStrategy(), devices=world)
    fsdp.launch()
    for name in ("sharded", "full.ckpt"):
        into = fsdp.setup_module(Net())
        fsdp.load(out / name, {"model": into})
        result[f"fsdp_loads_{name}"] = same(full(into), saved[name])
    mark("loaded into fsdp")

    # --- refusals
    result["product_error"] = expect_error(
        ValueError, "should equal the world size", Fabric, accelerator="cpu", devices=world,
        strategy=ModelParallelStrategy(parallelize, data_parallel_size=3),
    )  # fmt: skip
    if dp > 1:
        tp_only = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(lambda m, mesh: m, data_parallel_size=dp))
        tp_only.launch()
        result["unsynchronised_error"] = expect_error(ValueError, "would drift apart", tp_only.setup_module, Net())
    not_module = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(lambda m, mesh: None))
    not_module.launch()
    result["return_error"] = expect_error(TypeError, "must return a `nn.Module`", not_module.setup_module, Net())
    if fabric.global_rank == 0:
        dump(out / "result.json", result)
    mark("done")


if __name__ == "__main__":
    main()
