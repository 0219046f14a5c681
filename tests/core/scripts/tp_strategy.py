"""A small tensor-parallel strategy, written as a third party would from the docs: the parameters of a two-layer
MLP become DTensors split over every process (a 1-D mesh), so its processes must all see the same batches."""

from __future__ import annotations

import torch
from torch import nn

from fabric_core.strategies import ParallelStrategy

D_IN, D_HIDDEN, D_OUT = 8, 16, 4


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.ReLU(), nn.Linear(D_HIDDEN, D_OUT))


class _TensorParallel(ParallelStrategy):
    """The first linear layer split by output features, the second by input features (Megatron style)."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("tensor_parallel",))
        return parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


class TensorParallelStrategy(_TensorParallel):
    """Declares that every process trains on the same data: they hold parts of one model, not replicas."""

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def data_parallel_size(self) -> int:
        return 1


class UndeclaredTensorParallelStrategy(_TensorParallel):
    """The same sharding, without saying which processes share data."""
