"""Data-parallel strategies: ``DistributedDataParallel`` (one process per device) and ``DataParallel``.

Process-group handling, ranks and collectives come from the core's :class:`ParallelStrategy`; what is DDP
specific is only how the module is wrapped, how gradient synchronisation is skipped, and how the wrapper is
removed again for checkpoints.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import DataParallel, Module
from torch.nn.parallel import DistributedDataParallel

from fabric_core.strategies import (
    BackwardSyncControl,
    Binding,
    OneProcessCollectives,
    ParallelStrategy,
    Strategy,
    split_parallel_options,
)
from fabric_core.utilities import set_rank

if TYPE_CHECKING:
    from fabric_core.accelerators import Accelerator
    from fabric_core.io import CheckpointIO
    from fabric_core.precision import Precision


def _reject_mps(strategy: Strategy, accelerator: Accelerator) -> None:
    if accelerator.device_type == "mps":
        raise ValueError(
            f"You set `strategy={type(strategy).__name__}` but strategies from the DDP family are not supported on the"
            " MPS accelerator (PyTorch has no process-group backend for MPS). Either explicitly set"
            " `accelerator='cpu'` or change the strategy (one MPS device: `Fabric(accelerator='mps', devices=1)`)."
        )


class _DDPBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)`` is DDP's ``no_sync()``: gradients stay local until it is left."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to"
                f" `{type(self).__name__}.no_backward_sync` is wrapped in `DistributedDataParallel`."
                f" Got: {type(module).__name__}."
            )
        return module.no_sync()


class DDPStrategy(ParallelStrategy):
    """Replicate the model in every process and average gradients during backward (``DistributedDataParallel``).

    Args:
        **kwargs: the keywords of :class:`~fabric_core.strategies.ParallelStrategy` (``start_method``: ``"popen"``,
            the default, re-runs the script for each extra local rank; ``"spawn"``, ``"fork"`` or ``"forkserver"``
            run a function given to ``fabric.launch`` in new processes; ``process_group_backend``; ``timeout``;
            ...); every other keyword goes to ``torch.nn.parallel.DistributedDataParallel``
            (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ...).
    """

    def __init__(self, **kwargs: Any) -> None:
        options, ddp_kwargs = split_parallel_options(kwargs)
        super().__init__(**options)
        self._ddp_kwargs = ddp_kwargs
        self._backward_sync = _DDPBackwardSyncControl()

    def attach(self, binding: Binding) -> None:
        _reject_mps(self, binding.accelerator)
        super().attach(binding)

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        return dict(self._ddp_kwargs)

    @property
    def backward_sync_control(self) -> BackwardSyncControl:
        return self._backward_sync

    def setup_module(self, module: Module) -> DistributedDataParallel:
        device = self.root_device
        if device.type == "cuda":
            # Build the wrapper on a side stream, so its initial parameter broadcast does not serialise with
            # work already queued on the default stream.
            with torch.cuda.stream(torch.cuda.Stream()):
                return DistributedDataParallel(module, device_ids=[device.index], **self._ddp_kwargs)
        return DistributedDataParallel(module, device_ids=None, **self._ddp_kwargs)

    def unwrap_module(self, module: Module) -> Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def __repr__(self) -> str:
        return f"DDPStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, start_method={self.start_method!r})"


class DataParallelStrategy(OneProcessCollectives, Strategy):
    """One process drives several GPUs with ``torch.nn.DataParallel`` (splits each batch, gathers outputs).

    Kept for compatibility; DDP is faster. There is nothing to launch and no process group; the collectives
    are the core's one-process ones (identities). On the CPU there are no devices to split over, so
    ``strategy="dp"`` becomes ``ddp`` with a warning (this plugin's ``fabric_adjust_strategy`` hook).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices

    def attach(self, binding: Binding) -> None:
        _reject_mps(self, binding.accelerator)
        if binding.accelerator.device_type == "cpu":
            raise ValueError(
                "`DataParallelStrategy` splits batches over GPUs and cannot run on the CPU. Use"
                " `Fabric(strategy='dp')` (which becomes 'ddp' on the CPU) or `strategy='ddp'`."
            )
        super().attach(binding)
        if self.parallel_devices is None:
            self.parallel_devices = list(binding.devices)
        set_rank(0)

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    def setup_module(self, module: Module) -> DataParallel:
        device_ids = [d.index for d in self.parallel_devices or [] if d.type == "cuda"]
        return DataParallel(module=module, device_ids=device_ids or None)

    def unwrap_module(self, module: Module) -> Module:
        return module.module if isinstance(module, DataParallel) else module

    def __repr__(self) -> str:
        return f"DataParallelStrategy(devices={self.parallel_devices})"
