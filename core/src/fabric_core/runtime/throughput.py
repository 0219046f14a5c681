"""Throughput and model FLOPs utilisation (MFU): ``Throughput``, ``ThroughputMonitor``, ``measure_flops``,
``get_available_flops``, with the well-known Fabric's arguments and results (docs/migrating.md).

Rates are rolling averages over the last ``window_size`` calls of ``update``: each call reports running totals
(elapsed time, batches, samples, optionally item lengths and FLOPs since the previous call), and ``compute`` divides
the growth between the oldest and newest entry of the window by the time between them. Per-device rates carry the
``device/`` prefix; the global ones (without prefix) are the per-device ones times the world size and are only
reported when there is more than one process. MFU is the per-device FLOP/s over the device's **dense** peak
(:meth:`fabric_core.accelerators.Accelerator.available_flops`); it is left out when the peak is unknown, as on
the CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from fabric_core.utilities.rank_zero import rank_zero_warn

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops"]



class _LaunchedFabric(Protocol):
    """What :class:`ThroughputMonitor` uses of a ``Fabric`` (this module stands below the facade)."""

    @property
    def accelerator(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def strategy(self) -> Any: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    def _validate_launched(self) -> None: ...
    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...


_NAME_DTYPES = {"64": torch.float64, "32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}


class _Window:
    """The last ``size`` values of a running total, which must increase strictly (a clear error otherwise)."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def check(self, value: float) -> None:
        if self.values and value <= self.values[-1]:
            raise ValueError(f"Expected the value to increase, last: {self.values[-1]}, current: {value}")

    @property
    def full(self) -> bool:
        return len(self.values) == self.values.maxlen

    def growth(self) -> float:
        return self.values[-1] - self.values[0]


class Throughput:
    """Batches, samples, items and FLOPs per second over a rolling window, and MFU.

    Args:
        available_flops: peak FLOP/s of one device (what MFU divides by); ``None``: no MFU.
        world_size: number of processes; the global rates are reported only when it is above 1.
        window_size: number of ``update`` calls the rates average over (at least 2).
        separator: between ``device`` and the metric name in the per-device keys.
        using_sparse_model: ``True`` multiplies ``available_flops`` by ``sparse_cuda_acceleration_factor`` (for
            models that use 2:4 structured sparsity). ``None`` and ``False`` mean a dense model, the usual case,
            so no warning is given for ``None`` (the reference warns).
        sparse_cuda_acceleration_factor: at least 1 (default 2, NVIDIA's 2:4 sparsity).
    """

    def __init__(
        self,
        available_flops: float | None = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
        using_sparse_model: bool | None = None,
        sparse_cuda_acceleration_factor: float = 2.0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"`world_size` must be a positive integer, got {world_size!r}.")
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"`window_size` must be an integer of at least 2 (rates need two points), got {window_size!r}.")
        if sparse_cuda_acceleration_factor < 1:
            raise ValueError(
                f"`sparse_cuda_acceleration_factor` must be at least 1 (sparsity cannot lower the peak), got"
                f" {sparse_cuda_acceleration_factor!r}."
            )
        if using_sparse_model and available_flops is not None:
            available_flops = available_flops * sparse_cuda_acceleration_factor
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time = _Window(window_size)
        self._batches = _Window(window_size)
        self._samples = _Window(window_size)
        self._lengths = _Window(window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None) -> None:
        """Record running totals after some work.

        Args:
            time: seconds since the start; must increase with every call.
            batches: batches this process has seen in total; must increase.
            samples: samples this process has seen in total (at least ``batches``); must increase.
            lengths: items (e.g. tokens) this process has seen in total (at least ``samples``); give it on every
                call or on none.
            flops: FLOPs this process did since the previous call (e.g. ``measure_flops(...)`` times the batches
                since then).

        A value that does not increase raises ``ValueError`` and records nothing.
        """
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        if lengths is not None and lengths < samples:
            raise ValueError(f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
        if (lengths is not None) != bool(self._lengths.values) and self._time.values:
            raise RuntimeError(
                f"If lengths are passed ({len(self._lengths.values) + (lengths is not None)}), there needs to be the"
                f" same number of samples ({len(self._samples.values) + 1}): pass `lengths` on every `update` or"
                " on none."
            )
        for window, value in ((self._time, time), (self._batches, batches), (self._samples, samples)):
            window.check(value)
        if lengths is not None:
            self._lengths.check(lengths)
        self._time.values.append(time)
        self._batches.values.append(batches)
        self._samples.values.append(samples)
        if lengths is not None:
            self._lengths.values.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)  # all processes together

    def compute(self) -> dict[str, int | float]:
        """The totals of the last ``update`` and, once the window is full, the rates (see the module docstring)."""
        if not self._time.values:
            raise RuntimeError("`Throughput.compute()` needs at least one `update(...)` first.")
        metrics: dict[str, int | float] = {
            "time": self._time.values[-1],
            "batches": self._batches.values[-1],
            "samples": self._samples.values[-1],
        }
        if self._lengths.values:
            metrics["lengths"] = self._lengths.values[-1]
        device = f"device{self.separator}"
        several = self.world_size > 1
        if self._time.full:
            elapsed = self._time.growth()
            rates = {"batches_per_sec": self._batches.growth() / elapsed, "samples_per_sec": self._samples.growth() / elapsed}
            if self._lengths.full:
                rates["items_per_sec"] = self._lengths.growth() / elapsed
            for name, rate in rates.items():
                metrics[device + name] = rate
                if several:
                    metrics[name] = rate * self.world_size
        if len(self._flops) == self._flops.maxlen:
            # The first entry is the work before the window's first time stamp: it is not in the elapsed time.
            flops_per_sec = (sum(self._flops) - self._flops[0]) / self._time.growth()
            if several:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[device + "flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                metrics[device + "mfu"] = flops_per_sec / self.world_size / self.available_flops
        return metrics

    def reset(self) -> None:
        """Forget every recorded value (e.g. after a pause that should not count)."""
        for window in (self._time, self._batches, self._samples, self._lengths):
            window.values.clear()
        self._flops.clear()


class ThroughputMonitor(Throughput):
    """:class:`Throughput` for a Fabric run: world size and peak FLOP/s come from ``fabric``, and
    :meth:`compute_and_log` sends the metrics to ``fabric``'s loggers.

    ``update``, ``compute``, ``compute_and_log`` and ``reset`` act on global rank 0 only (elsewhere ``compute``
    and ``compute_and_log`` return ``{}``), so every process may call them. The peak is that of ``fabric.device``
    for the precision's compute dtype (``bf16-mixed`` computes in bfloat16); ``available_flops=`` overrides it.

    Args:
        fabric: a launched Fabric (the world size must be final).
        **kwargs: the other arguments of :class:`Throughput`.
    """

    def __init__(self, fabric: _LaunchedFabric, **kwargs: Any) -> None:
        fabric._validate_launched()
        if "available_flops" not in kwargs:
            kwargs["available_flops"] = _accelerator_flops(fabric.accelerator, fabric.device, compute_dtype(fabric.strategy.precision))
        super().__init__(world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        #: the step the next :meth:`compute_and_log` logs at when it is given none (-1 before the first)
        self.step = -1

    def update(self, **kwargs: Any) -> None:
        if self._fabric.is_global_zero:
            super().update(**kwargs)

    def compute(self) -> dict[str, int | float]:
        return super().compute() if self._fabric.is_global_zero else {}

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> dict[str, int | float]:
        """:meth:`compute`, then ``fabric.log_dict(metrics, step)``; ``step`` defaults to the previous one plus 1."""
        if not self._fabric.is_global_zero:
            return {}
        self.step = self.step + 1 if step is None else step
        metrics = self.compute(**kwargs)
        self._fabric.log_dict(metrics=metrics, step=self.step)
        return metrics

    def reset(self) -> None:
        if self._fabric.is_global_zero:
            super().reset()


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of ``forward_fn()`` (and, with ``loss_fn``, of ``loss_fn(forward_fn()).backward()`` as well).

    Counted by ``torch.utils.flop_counter.FlopCounterMode``. Build the model and inputs on the meta device to count
    without computing or allocating anything::

        with torch.device("meta"):
            model = MyModel()
            x = torch.randn(2, 32)
        forward_flops = measure_flops(model, lambda: model(x))
        training_flops = measure_flops(model, lambda: model(x), lambda y: y.sum())

    ``model`` is the module ``forward_fn`` runs (kept for the reference's signature).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return counter.get_total_flops()


def compute_dtype(precision: Any) -> torch.dtype:
    """The dtype a precision's (a :class:`~fabric_core.precision.Precision`) matmuls run in, from its canonical name (``"bf16-mixed"`` -> bfloat16); a name
    that does not say (a third party's) falls back to the dtype inputs are cast to, else float32."""
    prefix = str(getattr(precision, "precision", "")).split("-", 1)[0]
    if prefix in _NAME_DTYPES:
        return _NAME_DTYPES[prefix]
    dtype = getattr(precision, "input_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def get_available_flops(device: torch.device | str, dtype: torch.dtype) -> int | None:
    """Peak dense FLOP/s of one ``device`` computing in ``dtype``; ``None`` when unknown (always on the CPU).

    Asks the accelerator registered for ``device``'s type (CUDA: NVIDIA's datasheet figures; TPUs: fabric-xla).
    """
    from fabric_core.plugins import get_registry

    device = torch.device(device)
    entry = get_registry().lookup("accelerator", device.type)
    if entry is None:
        return None
    flops = _accelerator_flops(entry.load(), device, dtype)
    return int(flops) if flops else None


def _accelerator_flops(accelerator: Any, device: torch.device, dtype: torch.dtype) -> float | None:
    """The accelerator's (class's or object's) answer; a warning when it keeps a table but ``device`` is not in it."""
    flops = accelerator.available_flops(device, dtype)
    if flops is None and not _is_default(accelerator):
        rank_zero_warn(
            f"The peak FLOP/s of {_device_name(device)} for {dtype} are not known, so MFU is not reported. Pass"
            " `available_flops=` (FLOP/s of one device) to `Throughput`/`ThroughputMonitor` to get it."
        )
    return flops


def _is_default(accelerator: Any) -> bool:
    """Whether ``accelerator`` keeps no table of peaks: its ``available_flops`` is the base class's (which lives in
    ``fabric_core.accelerators.base``, above this module, so it is recognised by where it is defined)."""
    cls = accelerator if isinstance(accelerator, type) else type(accelerator)
    owner = next((c for c in cls.__mro__ if "available_flops" in vars(c)), None)
    return owner is None or owner.__module__ == "fabric_core.accelerators.base"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return repr(torch.cuda.get_device_name(device))
    return f"the {device.type} device"
