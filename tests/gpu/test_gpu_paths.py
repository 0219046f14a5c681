"""The CUDA paths that the CPU suite can only read: run on a GPU by ``make gpu-lane`` (``pytest -m cuda``).

Each test is skipped with its reason where CUDA (or the plugin it needs) is absent, so the CPU suite collects them
and skips cleanly. Multi-process scenarios run as real jobs (``scripts/gpu_job.py``, NCCL): with 2 processes when
the machine has 2 GPUs, else 1 (NCCL refuses two ranks on one GPU in one communicator).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from jobs import read_json, run_script
from torch import nn

from fabric_core import Fabric

SCRIPTS = Path(__file__).parent / "scripts"
HAS_CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run by `make gpu-lane`)")]


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"`{module}` is not installed (plugins/{module.split('_')[-1]})"
    )


def _gpus() -> int:
    return min(2, torch.cuda.device_count()) if HAS_CUDA else 0


def _job(scenario: str, tmp_path: Path) -> dict:
    run_script(SCRIPTS / "gpu_job.py", scenario, str(tmp_path), str(_gpus()), timeout=150, tmp_path=tmp_path)
    return read_json(tmp_path / f"{scenario}.json")


# ------------------------------------------------------------------------------------------------ jobs (NCCL)
@pytest.mark.multiprocess
@_needs("fabric_ddp")
def test_ddp_over_nccl_keeps_the_ranks_equal(tmp_path: Path) -> None:
    r = _job("ddp", tmp_path)
    assert r["world_size"] == _gpus() and r["backend"] == "nccl"
    assert r["init_module_device"].startswith("cuda") and r["param_device"].startswith("cuda")
    assert r["losses"][-1] < r["losses"][0]
    assert max(r["param_sums"]) - min(r["param_sums"]) < 1e-4 * max(1.0, abs(r["param_sums"][0]))


@pytest.mark.multiprocess
@_needs("fabric_fsdp")
def test_fsdp_over_nccl_trains_and_round_trips_a_sharded_checkpoint(tmp_path: Path) -> None:
    r = _job("fsdp", tmp_path)
    assert r["world_size"] == _gpus() and r["backend"] == "nccl"
    assert r["param_device"].startswith("cuda")
    assert r["losses"][-1] < r["losses"][0]
    assert r["loaded_step"] == 8 and r["load_max_diff"] == 0.0
    assert r["async_saved"]


@pytest.mark.multiprocess
@_needs("fabric_deepspeed")
def test_deepspeed_zero2_on_gpu_trains_and_round_trips(tmp_path: Path) -> None:
    r = _job("deepspeed", tmp_path)
    assert r["world_size"] == _gpus() and r["backend"] == "nccl"
    assert r["param_device"].startswith("cuda")
    assert r["losses"][-1] < r["losses"][0]
    assert r["loaded_step"] == 8 and r["load_max_diff"] == 0.0


# ------------------------------------------------------------------------------------------------ one process
def test_bf16_true_puts_the_model_in_bfloat16_on_the_device() -> None:
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-true")
    with fabric.init_module():
        model = nn.Linear(16, 4)
    assert model.weight.device.type == "cuda" and model.weight.dtype == torch.bfloat16
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = model(torch.randn(8, 16, device=fabric.device))
    assert out.dtype == torch.bfloat16
    fabric.backward(out.float().pow(2).mean())
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.weight)


@_needs("fabric_amp")
def test_bf16_mixed_runs_the_forward_under_cuda_autocast() -> None:
    seen = {}

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            seen["dtype"], seen["autocast"] = y.dtype, torch.is_autocast_enabled("cuda")
            return y

    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    model = fabric.setup(Probe(8, 2))
    assert model.weight.dtype == torch.float32 and model.weight.device.type == "cuda"
    out = model(torch.randn(4, 8, device=fabric.device))
    assert seen == {"dtype": torch.bfloat16, "autocast": True}
    assert out.dtype == torch.float32  # the output is cast back, as for the reference


def test_async_save_snapshots_gpu_tensors_before_training_changes_them(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cuda", devices=1)
    model = fabric.setup(nn.Linear(256, 256))
    snapshot = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = fabric.save(tmp_path / "async.ckpt", {"model": model, "step": 1}, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the write runs
    handle.wait()
    fresh = fabric.setup(nn.Linear(256, 256))
    rest = fabric.load(tmp_path / "async.ckpt", {"model": fresh})
    assert rest == {"step": 1}
    for k, v in fresh.state_dict().items():
        assert v.device.type == "cuda"
        torch.testing.assert_close(v.cpu(), snapshot[k], rtol=0, atol=0)


def test_throughput_monitor_reports_mfu_on_the_gpu() -> None:
    from fabric_core.utilities import ThroughputMonitor, measure_flops

    fabric = Fabric(accelerator="cuda", devices=1, precision="32-true")
    name = torch.cuda.get_device_name(0)
    monitor = ThroughputMonitor(fabric, window_size=3)
    if monitor.available_flops is None:
        pytest.skip(f"the peak FLOP/s of {name!r} are not in the table, so no MFU: nothing to check")
    model = fabric.setup(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)))
    x = torch.randn(256, 1024, device=fabric.device)
    flops = measure_flops(model, lambda: model(x), lambda y: y.sum())
    assert flops > 2 * 3 * 256 * 1024 * 1024  # forward and backward of two matmuls at least
    start = time.perf_counter()
    for step in range(1, 5):
        F.relu(model(x)).sum().backward()
        torch.cuda.synchronize()
        monitor.update(time=time.perf_counter() - start, batches=step, samples=256 * step, flops=flops)
    metrics = monitor.compute()
    assert 0 < metrics["device/mfu"] < 1, metrics
    assert metrics["device/flops_per_sec"] == pytest.approx(metrics["device/mfu"] * monitor.available_flops)
