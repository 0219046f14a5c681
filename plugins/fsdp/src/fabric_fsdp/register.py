"""fabric-fsdp's hook implementations: names, the FSDP precision, and reading sharded checkpoints.

Importing this module is cheap: targets are import strings, and ``torch.distributed`` is only imported when a
hook actually has to answer for FSDP (an FSDP strategy exists, or a path is an FSDP checkpoint).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.io.location import CheckpointLocation
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.plugins import Registrar, Registry
    from fabric_core.strategies.base import Strategy

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


@hookimpl(tryfirst=True)
def fabric_select_precision(registry: Registry, precision: str, strategy: Strategy, accelerator: Accelerator) -> Any:
    """FSDP strategies get an ``FSDPPrecision`` (mixed precision as an FSDP policy, not autocast)."""
    module = sys.modules.get("fabric_fsdp.strategy")  # not imported means no FSDP strategy can exist
    if module is None or not isinstance(strategy, module.FSDPStrategy):
        return None
    from fabric_fsdp.precision import SUPPORTED, FSDPPrecision

    if precision not in SUPPORTED:
        return None  # e.g. 64-true: the core's precision casts the model and FSDP2 shards it as it is
    return FSDPPrecision(precision)


@hookimpl
def fabric_select_checkpoint_reader(path: CheckpointLocation) -> Any:
    """Read a sharded FSDP checkpoint directory (DCP ``.metadata`` plus our ``meta.pt``) in one process."""
    from fabric_fsdp.layout import is_sharded_checkpoint

    if not is_sharded_checkpoint(path):
        return None
    from fabric_fsdp.checkpoint import load_sharded_checkpoint

    return load_sharded_checkpoint
