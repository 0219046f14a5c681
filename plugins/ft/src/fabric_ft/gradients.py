"""Averaging gradients across replica groups, after whatever the strategy inside a group did with them.

Three shapes of model come out of the strategy that runs inside a replica group, and each has one place where the
gradients are final for the group and can be averaged across the groups of the quorum through torchft's
fault-tolerant process group (``manager.allreduce``: an error there is recorded by the manager and the step is not
committed anywhere, instead of failing the backward pass):

* FSDP2 units (``fully_shard``): the all-reduce hook, which FSDP2 calls with each unit's reduce-scattered gradient
  shard (HSDP: shards inside a group, replicas across). Process ``r`` of every group holds the same shard, and
  torchft's process group joins the same group rank across groups.
* ``DistributedDataParallel`` over the group's processes: a communication hook that averages each bucket inside the
  group first, then across groups.
* A plain module (one process per group): torchft's ``DistributedDataParallel``, whose hook averages across groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module

__all__ = ["average_across_groups", "single_process_ddp"]


def _fsdp_units(module: Module) -> list[Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def average_across_groups(manager: Any, module: Module, plain: Module) -> Module:
    """Make the backward pass of ``module`` (what the strategy inside the group returned; ``plain`` is the user's
    module in it) average gradients across the replica groups too; returns the module to run forward through."""
    from torch.nn.parallel import DistributedDataParallel

    units = _fsdp_units(plain)
    if units:

        def reduce_shard(output: torch.Tensor) -> None:
            manager.allreduce(output).wait()

        for unit in units:
            unit.set_all_reduce_hook(reduce_shard)  # type: ignore[operator]
        return module
    if isinstance(module, DistributedDataParallel):
        if not module.find_unused_parameters:
            raise ValueError(
                "Fault tolerance over `ddp` needs `find_unused_parameters=True`: otherwise DDP regroups its gradient"
                " buckets after the first step, and a restarted group (which has not regrouped yet) would average"
                " buckets that do not match the others'. Pass it to the strategy, e.g."
                " `FaultTolerant('ddp', find_unused_parameters=True)`."
            )
        module.register_comm_hook(manager, _group_then_replicas)
        return module
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"Fault tolerance cannot average the gradients of a `{type(module).__name__}` across replica groups: the"
            " strategy inside each group must shard the model with FSDP2 (`fsdp`), replicate it with DDP (`ddp`), or"
            " run one process per group (`ft_ddp`)."
        )
    return single_process_ddp(manager, module)


def _group_then_replicas(manager, bucket):  # type: ignore[no-untyped-def]  # torch rejects string annotations here
    """DDP's communication hook under fault tolerance: the bucket averaged over this group's processes, then over the
    replica groups of the quorum (torchft; a failure there drops the step instead of failing backward)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer, op=dist.ReduceOp.AVG)
    manager.allreduce(buffer).wait()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def single_process_ddp(manager: Any, module: Module) -> Module:
    """torchft's ``DistributedDataParallel`` for a one-process group, with a hook that survives a failed step."""
    return _ddp_class()(manager, module)


_DDP: type | None = None


def _ddp_class() -> type:
    global _DDP
    if _DDP is not None:
        return _DDP
    from torchft import DistributedDataParallel
    from torchft.manager import _ManagedFuture

    class FTDistributedDataParallel(DistributedDataParallel):
        """torchft's DDP with a comm hook that survives a step already failed.

        Once the manager has seen an error in a step (a peer died, the group could not be reconfigured), its
        ``allreduce`` returns a finished dummy work whose future is a plain one; torchft 0.2.0's hook (and its main
        branch at 73dafea) asserts the managed future's inner one exists and fails the backward pass with an
        ``AssertionError``, killing the survivor. Here the bucket is handed back unreduced instead: the step is
        dropped by ``should_commit`` anyway.
        """

        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks real annotations; ours are strings
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", None) if isinstance(future, _ManagedFuture) else future
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    _DDP = FTDistributedDataParallel
    return _DDP
