"""fabric-deepspeed's hook implementations: names, the DeepSpeed precision, and reading DeepSpeed checkpoints.

Importing this module is cheap: targets are import strings, and neither torch nor deepspeed is imported here. The
precision hook answers only when a DeepSpeed strategy exists (its module is then imported already); the reader
hook recognises a directory from its file names before importing anything.
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

_STRATEGY = "fabric_deepspeed.strategy:DeepSpeedStrategy"
_OFFLOAD_BOTH = {"offload_optimizer": True, "offload_parameters": True}


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add("deepspeed", _STRATEGY, description="DeepSpeed ZeRO stage 2 (optimizer state and gradients partitioned)")
    registrar.add("deepspeed_stage_1", _STRATEGY, description="DeepSpeed ZeRO stage 1: optimizer state partitioned", stage=1)
    registrar.add(
        "deepspeed_stage_1_offload",
        _STRATEGY,
        description="DeepSpeed ZeRO stage 1, optimizer state in CPU memory",
        stage=1,
        offload_optimizer=True,
    )
    registrar.add(
        "deepspeed_stage_2", _STRATEGY, description="DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned", stage=2
    )
    registrar.add(
        "deepspeed_stage_2_offload",
        _STRATEGY,
        description="DeepSpeed ZeRO stage 2, optimizer state in CPU memory",
        stage=2,
        offload_optimizer=True,
    )
    registrar.add(
        "deepspeed_stage_3",
        _STRATEGY,
        description="DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state partitioned",
        stage=3,
    )
    registrar.add(
        "deepspeed_stage_3_offload",
        _STRATEGY,
        description="DeepSpeed ZeRO stage 3, parameters and optimizer state in CPU memory",
        stage=3,
        **_OFFLOAD_BOTH,
    )
    registrar.add(
        "deepspeed_stage_3_offload_nvme",
        _STRATEGY,
        description="DeepSpeed ZeRO stage 3, parameters and optimizer state on NVMe (needs libaio; JIT-compiles async_io)",
        stage=3,
        remote_device="nvme",
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        **_OFFLOAD_BOTH,
    )


@hookimpl(tryfirst=True)
def fabric_select_precision(registry: Registry, precision: str, strategy: Strategy, accelerator: Accelerator) -> Any:
    """DeepSpeed strategies get a ``DeepSpeedPrecision`` (the engine's own casting); other names are refused."""
    module = sys.modules.get("fabric_deepspeed.strategy")  # not imported means no DeepSpeed strategy can exist
    if module is None or not isinstance(strategy, module.DeepSpeedStrategy):
        return None
    from fabric_deepspeed.precision import DeepSpeedPrecision

    if accelerator.device_type == "cpu" and precision in ("16-mixed", "16-true"):
        raise ValueError(
            f"`precision={precision!r}` is not supported by DeepSpeed on the CPU (its fp16 needs a GPU). Use"
            " `precision='bf16-mixed'` (or 'bf16-true') on the CPU."
        )
    return DeepSpeedPrecision(precision)  # ValueError with the supported names for anything else


@hookimpl
def fabric_select_checkpoint_reader(path: CheckpointLocation) -> Any:
    """Read a DeepSpeed checkpoint directory (a ``latest`` tag and its model states) in one process."""
    from fabric_deepspeed.layout import is_deepspeed_checkpoint

    if not is_deepspeed_checkpoint(path):
        return None
    from fabric_deepspeed.checkpoint import load_deepspeed_checkpoint

    return load_deepspeed_checkpoint
