"""fabric_core.runtime.throughput: the reference's documented examples, exact rates, MFU and the peak table."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fabric_core import Fabric
from fabric_core.accelerators.cuda_flops import CUDA_FLOPS, chip_of, cuda_flops
from fabric_core.loggers.base import Logger
from fabric_core.runtime.throughput import (
    Throughput,
    ThroughputMonitor,
    compute_dtype,
    get_available_flops,
    measure_flops,
)


class RecordingLogger(Logger):
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int | None]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params: dict, *args: object, **kwargs: object) -> None:
        pass


# ---------------------------------------------------------------------------------------- the reference's examples


def test_monitor_docstring_example_logs_totals_until_the_window_is_full() -> None:
    """The reference's ``ThroughputMonitor`` example: 99 updates, ``compute_and_log(step=i)`` every 10th. With the
    default window of 100 updates no rate is ever complete, so each log holds the running totals only."""
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    throughput = ThroughputMonitor(fabric)
    for i in range(1, 100):
        t = 0.25 * i  # what `time() - t0` would give for 0.25 s per iteration
        throughput.update(time=t, batches=i, samples=i)
        if i % 10 == 0:
            throughput.compute_and_log(step=i)
    assert [step for _, step in logger.logged] == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert logger.logged[-1][0] == {"time": 22.5, "batches": 90, "samples": 90}
    assert throughput.step == 90


def test_monitor_with_a_full_window_reports_device_rates_and_steps_itself() -> None:
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    throughput = ThroughputMonitor(fabric, window_size=4)
    assert throughput.available_flops is None  # the CPU has no peak: no MFU
    for i in range(1, 9):
        throughput.update(time=0.5 * i, batches=i, samples=8 * i, lengths=256 * i, flops=1000)
        throughput.compute_and_log()
    metrics, step = logger.logged[-1]
    assert step == 7  # counted from -1 when no step is given
    # world size 1: exactly the totals and the device/ rates (what the reference reports)
    assert set(metrics) == {
        "time", "batches", "samples", "lengths", "device/batches_per_sec", "device/samples_per_sec",
        "device/items_per_sec", "device/flops_per_sec",
    }  # fmt: skip
    assert metrics["device/batches_per_sec"] == pytest.approx(2.0)
    assert metrics["device/samples_per_sec"] == pytest.approx(16.0)
    assert metrics["device/items_per_sec"] == pytest.approx(512.0)
    assert metrics["device/flops_per_sec"] == pytest.approx(2000.0)  # 3 x 1000 FLOPs over 1.5 s


def test_measure_flops_docstring_example_on_the_meta_device() -> None:
    """The reference's ``measure_flops`` example, on a model whose FLOPs are known: a linear layer does
    2*batch*in*out in forward, and in backward the same again for the weight gradient and, where the input needs a
    gradient (not for the first layer), for the input gradient."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        x = torch.randn(2, 32)
    model_fwd = lambda: model(x)  # noqa: E731 (the example's style)
    fwd_flops = measure_flops(model, model_fwd)
    model_loss = lambda y: y.sum()  # noqa: E731
    fwd_and_bwd_flops = measure_flops(model, model_fwd, model_loss)
    first, second = 2 * 2 * 32 * 64, 2 * 2 * 64 * 10
    assert fwd_flops == first + second
    assert fwd_and_bwd_flops == (first + second) + (first + second) + second


def test_measure_flops_matches_torch_flop_counter_on_a_transformer_layer() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    x = torch.randn(3, 7, 32)
    with FlopCounterMode(display=False) as counter:
        layer(x).pow(2).mean().backward()
    expected = counter.get_total_flops()
    layer.zero_grad()
    assert measure_flops(layer, lambda: layer(x), lambda y: y.pow(2).mean()) == expected > 0


# ---------------------------------------------------------------------------------------- rates


def test_global_rates_and_mfu_with_several_processes() -> None:
    throughput = Throughput(available_flops=500.0, world_size=2, window_size=3)
    for i in (1, 2, 3):
        throughput.update(time=float(i), batches=i, samples=4 * i, lengths=40 * i, flops=100)
    metrics = throughput.compute()
    assert metrics == pytest.approx(
        {
            "time": 3.0, "batches": 3, "samples": 12, "lengths": 120,
            "device/batches_per_sec": 1.0, "batches_per_sec": 2.0,
            "device/samples_per_sec": 4.0, "samples_per_sec": 8.0,
            "device/items_per_sec": 40.0, "items_per_sec": 80.0,
            # each update reports 100 FLOPs per process since the previous one; the first is before the window
            "flops_per_sec": 200.0, "device/flops_per_sec": 100.0, "device/mfu": 0.2,
        }
    )  # fmt: skip


def test_separator_and_sparse_models() -> None:
    throughput = Throughput(available_flops=1000.0, window_size=2, separator=".", using_sparse_model=True)
    assert throughput.available_flops == 2000.0
    throughput.update(time=1.0, batches=1, samples=1, flops=10)
    throughput.update(time=2.0, batches=2, samples=2, flops=10)
    assert throughput.compute()["device.mfu"] == pytest.approx(10 / 2000)
    assert Throughput(available_flops=1000.0, using_sparse_model=True, sparse_cuda_acceleration_factor=1.5).available_flops == 1500.0


def test_reset_forgets_everything() -> None:
    throughput = Throughput(window_size=2)
    throughput.update(time=1.0, batches=1, samples=1)
    throughput.reset()
    throughput.update(time=0.5, batches=1, samples=1)  # smaller than before the reset: fine
    assert throughput.compute() == {"time": 0.5, "batches": 1, "samples": 1}


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("second", "error", "match"),
    [
        ({"time": 1.0, "batches": 2, "samples": 2}, ValueError, "Expected the value to increase, last: 1.0, current: 1.0"),
        ({"time": 2.0, "batches": 1, "samples": 2}, ValueError, "Expected the value to increase, last: 1, current: 1"),
        ({"time": 2.0, "batches": 3, "samples": 2}, ValueError, r"Expected samples \(2\) to be greater or equal than batches \(3\)"),
        ({"time": 2.0, "batches": 2, "samples": 2, "lengths": 1}, ValueError, r"Expected lengths \(1\) to be greater"),
        ({"time": 2.0, "batches": 2, "samples": 2, "lengths": 4}, RuntimeError, "If lengths are passed"),
    ],
)
def test_bad_updates_raise_and_record_nothing(second: dict, error: type, match: str) -> None:
    throughput = Throughput(window_size=2)
    throughput.update(time=1.0, batches=1, samples=1)
    with pytest.raises(error, match=match):
        throughput.update(**second)
    assert throughput.compute() == {"time": 1.0, "batches": 1, "samples": 1}  # the failed update left no trace


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`window_size` must be an integer of at least 2"):
        Throughput(window_size=1)
    with pytest.raises(ValueError, match="`world_size` must be a positive integer"):
        Throughput(world_size=0)
    with pytest.raises(ValueError, match="sparsity cannot lower the peak"):
        Throughput(sparse_cuda_acceleration_factor=0.5)
    with pytest.raises(RuntimeError, match="needs at least one `update"):
        Throughput().compute()


def test_monitor_needs_a_launched_fabric() -> None:
    from fabric_core.strategies import ParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ParallelStrategy())  # the core's (no fabric-ddp needed)
    with pytest.raises(RuntimeError, match="you must call `.launch\\(\\)`"):
        ThroughputMonitor(fabric)


# ---------------------------------------------------------------------------------------- peak FLOP/s


@pytest.mark.parametrize(
    ("name", "chip"),
    [
        ("NVIDIA H200", "h200 sxm"),
        ("NVIDIA H200 NVL", "h200 nvl"),
        ("NVIDIA GH200 480GB", "h200 sxm"),
        ("NVIDIA H100 80GB HBM3", "h100 sxm"),
        ("NVIDIA H100 PCIe", "h100 pcie"),
        ("NVIDIA H100 NVL", "h100 nvl"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", None),
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA GeForce RTX 4090", "rtx 4090"),
        ("NVIDIA GeForce RTX 4080 SUPER", "rtx 4080 super"),
        ("NVIDIA GeForce RTX 3080 Ti", "rtx 3080 ti"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-16GB", "v100 sxm"),
        ("Tesla V100-PCIE-32GB", "v100 pcie"),
        ("Tesla V100S-PCIE-32GB", "v100s pcie"),
        ("Some Future GPU", None),
    ],
)
def test_device_names(name: str, chip: str | None) -> None:
    assert chip_of(name) == chip


def test_hopper_peaks_are_dense() -> None:
    # NVIDIA's datasheets: 1,979 TFLOP/s bf16 "with sparsity" for H100 SXM and H200 SXM, i.e. 989.4 dense.
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert cuda_flops(name, torch.bfloat16, tf32_matmuls=False) == pytest.approx(989.4e12)
        assert cuda_flops(name, torch.float16, tf32_matmuls=False) == pytest.approx(989.4e12)
        assert cuda_flops(name, torch.float32, tf32_matmuls=False) == pytest.approx(67e12)
        assert cuda_flops(name, torch.float32, tf32_matmuls=True) == pytest.approx(494.7e12)
    assert cuda_flops("NVIDIA A100-SXM4-40GB", torch.bfloat16, tf32_matmuls=True) == pytest.approx(312e12)
    assert cuda_flops("Tesla T4", torch.bfloat16, tf32_matmuls=False) is None  # no bf16 Tensor Cores
    assert cuda_flops("Tesla V100-SXM2-16GB", torch.float32, tf32_matmuls=True) == pytest.approx(15.7e12)  # no TF32


def test_table_is_consistent() -> None:
    for chip, table in CUDA_FLOPS.items():
        assert table[torch.float32] > 0, chip
        for dtype in (torch.bfloat16, torch.float16):
            if dtype in table:  # Tensor Cores are at least as fast as float32 math
                assert table[dtype] >= table[torch.float32], (chip, dtype)
        if torch.int8 in table and torch.float16 in table:
            assert table[torch.int8] >= table[torch.float16], chip


def test_cpu_has_no_peak_and_no_mfu() -> None:
    assert get_available_flops(torch.device("cpu"), torch.float32) is None
    assert get_available_flops("cpu", torch.bfloat16) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_peak() -> None:
    flops = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
    expected = cuda_flops(torch.cuda.get_device_name(0), torch.bfloat16, tf32_matmuls=False)
    assert flops == (int(expected) if expected else None)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("64-true", torch.float64), ("bf16-true", torch.bfloat16), ("16-true", torch.float16)],
)
def test_compute_dtype_follows_the_precision(precision: str, dtype: torch.dtype) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    assert compute_dtype(fabric.strategy.precision) is dtype


def test_compute_dtype_of_mixed_and_unknown_precisions() -> None:
    class Mixed:
        precision = "bf16-mixed"

    class ThirdParty:
        precision = "fp8-transformer-engine"
        input_dtype = torch.float16

    assert compute_dtype(Mixed()) is torch.bfloat16
    assert compute_dtype(ThirdParty()) is torch.float16
