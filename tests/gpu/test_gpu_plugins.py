"""The CUDA paths of the plugins with heavy GPU libraries, run by ``make gpu-lane`` (``pytest -m cuda``) on a lent GPU:
bitsandbytes in every mode and its 8-bit optimizers, real (not emulated) float8 matmuls, and ``ft_ddp`` with
ProcessGroupNCCL between replica groups and a real lighthouse. Each is checked against the library itself (the same
model converted by bitsandbytes' or torchao's own calls, trained by a plain loop). Without CUDA every test here skips;
without the plugin's library it fails (the lane installs it from the wheels it carries: benchmarks/gpu_wheels.py).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from jobs import free_port, job_env, start_job
from torch import nn

from fabric_core import Fabric

HAS_CUDA = torch.cuda.is_available()
FLOAT8 = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run by `make gpu-lane`)")]

MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")


class Net(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(64, width)
        self.down = nn.Linear(width, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _batch(device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    return x.to(device), (x[:, :16] * 2).sin().to(device)


# ------------------------------------------------------------------------------------------------ bitsandbytes
def _bnb_reference(model: nn.Module, mode: str) -> nn.Module:
    """The same model with every Linear replaced by bitsandbytes' own layer holding the same weights, quantized by
    bitsandbytes' own ``.cuda()``."""
    import bitsandbytes as bnb

    reference = copy.deepcopy(model)
    for name in ("up", "down", "head"):
        old = getattr(reference, name)
        if mode.startswith("int8"):
            training = mode == "int8-training"
            new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, has_fp16_weights=training, threshold=6.0)
            new.weight = bnb.nn.Int8Params(old.weight.data.half(), requires_grad=training, has_fp16_weights=training)
            new.bias = nn.Parameter(old.bias.data.half(), requires_grad=old.bias.requires_grad)
        else:
            quant_type, double = mode.split("-")[0], mode.endswith("-dq")
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, compute_dtype=torch.bfloat16,
                                    compress_statistics=double, quant_type=quant_type)  # fmt: skip
            new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, compress_statistics=double, quant_type=quant_type)
            new.bias = nn.Parameter(old.bias.data.to(torch.bfloat16))
        setattr(reference, name, new)
    return reference.cuda()


@pytest.mark.parametrize("mode", MODES)
def test_bitsandbytes_mode_on_cuda_equals_bitsandbytes_own_layers(mode: str, tmp_path: Path) -> None:
    import bitsandbytes as bnb
    from fabric_bnb.layers import LAYERS

    torch.manual_seed(0)
    plain = Net()
    reference = _bnb_reference(plain, mode)
    fabric = Fabric(accelerator="cuda", devices=1, precision=f"bnb-{mode}")
    model = fabric.setup(copy.deepcopy(plain))
    assert all(type(getattr(model, n)) is LAYERS[mode] for n in ("up", "down", "head"))
    weight = model.up.weight
    assert weight.device.type == "cuda"
    assert weight.dtype == {"int8": torch.int8, "int8-training": torch.float16}.get(mode, torch.uint8), weight.dtype
    x, _ = _batch()
    dtype = fabric.strategy.precision.dtype
    with torch.no_grad():
        ours = model(x)
        theirs = reference(x.to(dtype)).float()
    assert ours.device.type == "cuda" and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3 if mode.startswith("int8") else 1e-2)

    # training on the GPU: a LoRA-style adapter beside the frozen quantized layers (int8-training trains all)
    head = nn.Linear(64, 16, device="cuda", dtype=dtype)
    trainable = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = fabric.setup_optimizers(bnb.optim.AdamW8bit(trainable, lr=1e-2, min_8bit_size=16))
    _, y = _batch()
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        features = model(x)
        loss = nn.functional.mse_loss(features + head(features.to(dtype)).float(), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses

    model.eval()
    with torch.no_grad():
        before = model(x)
    fabric.save(tmp_path / "ckpt.pt", {"model": model})
    fresh_fabric = Fabric(accelerator="cuda", devices=1, precision=f"bnb-{mode}")
    with fresh_fabric.init_module(empty_init=True):
        fresh = Net()
    fresh = fresh_fabric.setup(fresh)
    fresh_fabric.load(tmp_path / "ckpt.pt", {"model": fresh})
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), before)


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit"])
def test_bitsandbytes_8bit_optimizers_on_cuda_train_like_the_plain_loop(name: str, tmp_path: Path) -> None:
    """Through fabric.setup on the GPU (the paged one really paged here): the same steps as the optimizer in a plain
    loop, 8-bit state on the GPU, and a save/load that continues to the bit."""
    import bitsandbytes as bnb

    cls = getattr(bnb.optim, name)
    torch.manual_seed(0)
    plain = Net().cuda()
    reference = copy.deepcopy(plain)
    fabric = Fabric(accelerator="cuda", devices=1)
    model, optimizer = fabric.setup(plain, cls(plain.parameters(), lr=1e-2, min_8bit_size=16))
    expected_opt = cls(reference.parameters(), lr=1e-2, min_8bit_size=16)
    x, y = _batch()
    for _ in range(5):
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        expected_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        expected_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    state = optimizer.optimizer.state[model.module.up.weight]
    assert state["state1"].dtype == torch.uint8 and state["state1"].device.type == "cuda"
    assert getattr(optimizer.optimizer, "is_paged", False) == (name == "PagedAdamW8bit")
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    torch.manual_seed(1)
    fresh = Net().cuda()
    fresh, fresh_opt = fabric.setup(fresh, cls(fresh.parameters(), lr=1e-2, min_8bit_size=16))
    fabric.load(tmp_path / "ckpt.pt", {"model": fresh, "optimizer": fresh_opt})
    for m, opt in ((model, optimizer), (fresh, fresh_opt)):
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(m(x), y))
        opt.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ float8
def _scaled_mm_calls(model: nn.Module, x: torch.Tensor) -> int:
    """How many float8 matmuls (``aten::_scaled_mm``) one forward and backward runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).float().sum().backward()
    return sum(e.count for e in prof.key_averages() if "_scaled_mm" in e.key)


@pytest.mark.skipif(not FLOAT8, reason="needs a GPU with float8 matmuls (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_runs_real_float8_matmuls_and_trains_like_torchao(recipe: str) -> None:
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    plain = Net().cuda().to(torch.bfloat16)
    library = copy.deepcopy(plain)
    name = "float8" if recipe == "tensorwise" else "float8-rowwise"
    fabric = Fabric(accelerator="cuda", devices=1, precision=name)
    assert fabric.strategy.precision.emulate is False  # real float8 on this GPU
    model = fabric.setup(plain)
    x, y = _batch()
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    assert _scaled_mm_calls(model, x) >= 3, "every converted layer's forward matmul in float8 (and its backward's)"
    model.zero_grad()
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=False)
    library = convert_to_float8_training(library, config=config)
    expected_opt = torch.optim.AdamW(library.parameters(), lr=1e-3)
    ours, theirs = [], []
    for _ in range(10):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        ours.append(loss.item())
        expected_opt.zero_grad()
        loss = nn.functional.mse_loss(library(x), y)
        loss.backward()
        expected_opt.step()
        theirs.append(loss.item())
    assert ours == pytest.approx(theirs, rel=1e-3), (ours, theirs)
    assert ours[-1] < ours[0], ours


# ------------------------------------------------------------------------------------------------ fault tolerance
def test_ft_ddp_over_nccl_with_a_lighthouse(tmp_path: Path) -> None:
    """Replica groups on the GPU (one per GPU, at most 2: NCCL refuses two ranks on one GPU in one communicator)
    join a real lighthouse, step together through ProcessGroupNCCL and end with equal weights and a lower loss."""
    import torchft  # noqa: F401  (the lane installs it; a missing one fails here)

    groups = min(2, torch.cuda.device_count())
    port = free_port()
    # torchft's console script: beside this interpreter in a venv, on PATH where the lane installed the wheels
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    lighthouse_cmd = [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(groups), "--join_timeout_ms", "2000"]
    lighthouse = start_job(lighthouse_cmd, tmp_path / "lighthouse.log")
    stop = tmp_path / "stop"
    stop.write_text("20")
    script = Path(__file__).parents[1] / "plugins" / "ft" / "scripts" / "ft_train.py"
    jobs = []
    for group in range(groups):
        env = job_env(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=str(group),
                      NUM_REPLICA_GROUPS=str(groups), CUDA_VISIBLE_DEVICES=str(group), FT_TEST_ACCELERATOR="cuda")  # fmt: skip
        jobs.append(start_job([sys.executable, script, tmp_path / f"g{group}", stop, "0"], tmp_path / f"g{group}.log", env))
    try:
        for job in jobs:
            assert job.wait(180) == 0, job.output()[-4000:]
    finally:
        lighthouse.process.terminate()
        lighthouse.wait(30)
    results = [json.loads((tmp_path / f"g{g}" / "result.json").read_text()) for g in range(groups)]
    for result in results:
        assert result["device"].startswith("cuda") and result["process_group"] == "ProcessGroupNCCL", result
        assert result["step"] == 20 and result["loss"] < 0.5 * result["initial_loss"], result
    records = [json.loads(line) for line in (tmp_path / "g0" / "progress.jsonl").read_text().splitlines()]
    assert all(r["committed"] and r["participants"] == groups for r in records[1:]), records[:5]
    weights = [torch.load(tmp_path / f"g{g}" / "final.pt") for g in range(groups)]
    for other in weights[1:]:
        for key, tensor in weights[0].items():
            assert torch.equal(tensor, other[key]), key
