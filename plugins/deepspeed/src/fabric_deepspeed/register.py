"""fabric-deepspeed's hook implementations: its strategies' names and its checkpoint format.

Importing this module is cheap: targets are import strings, and neither torch nor deepspeed is imported here. Its
checkpoint format is recognised from file names (``recognised_by``) before anything is imported. The DeepSpeed precision is the
strategy's own answer (``DeepSpeedStrategy.precision_for``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

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


@hookimpl
def fabric_register_checkpoint_formats(registrar: Registrar) -> None:
    registrar.add(
        "deepspeed",
        "fabric_deepspeed.checkpoint:DeepSpeedFormat",
        description="DeepSpeed's checkpoint folder, written by its engine on every rank",
        recognised_by="fabric_deepspeed.layout:is_deepspeed_checkpoint",
    )


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin, installed or not."""
    return ["deepspeed"]


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_deepspeed": "library", "deepspeed": "library", "deepspeed.comm": "collective"}
