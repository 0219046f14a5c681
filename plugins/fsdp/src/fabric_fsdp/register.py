"""fabric-fsdp's hook implementations: its strategies' names and its sharded checkpoint format.

Importing this module is cheap: targets are import strings, and ``torch.distributed`` is only imported when a
path is an FSDP checkpoint (``recognised_by`` looks at file names first). The FSDP precision is the strategy's own answer (``FSDPStrategy.precision_for``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_STRATEGY = "fabric_fsdp.strategy:FSDPStrategy"


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add("fsdp", _STRATEGY, description="fully sharded data parallel (FSDP2), sharded checkpoints")
    registrar.add(
        "fsdp_cpu_offload",
        _STRATEGY,
        description="FSDP with parameters, gradients and optimizer state offloaded to CPU memory",
        cpu_offload=True,
    )
    registrar.add(
        "fsdp_no_reshard",
        _STRATEGY,
        description="FSDP keeping gathered parameters from forward to backward (more memory, less communication)",
        reshard_after_forward=False,
    )
    registrar.add(
        "fsdp_hybrid",
        _STRATEGY,
        description="FSDP sharded within each node and replicated across nodes (2D device mesh)",
        sharding_strategy="HYBRID_SHARD",
    )
    registrar.add(
        "model_parallel",
        "fabric_fsdp.model_parallel:ModelParallelStrategy",
        description="FSDP2 x tensor x pipeline x sequence (Ulysses) parallel on one mesh; your parallelize_fn shards",
    )


@hookimpl
def fabric_register_checkpoint_formats(registrar: Registrar) -> None:
    registrar.add(
        "fsdp_sharded",
        "fabric_fsdp.checkpoint:ShardedFormat",
        description="a folder of DCP shards and meta.pt, written by every rank; loads on any number of ranks",
        recognised_by="fabric_fsdp.layout:is_sharded_checkpoint",
    )


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_fsdp": "library"}


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin (its dependency), installed or not."""
    return ["numpy"]
