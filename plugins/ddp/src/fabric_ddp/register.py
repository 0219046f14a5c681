"""Registration hooks of fabric-ddp: names only, as import strings, so discovering them imports no torch.

The ``fabric.plugins`` entry point of this distribution points here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar, Registry

_STRATEGY = "fabric_ddp.strategy:DDPStrategy"
_DP_STRATEGY = "fabric_ddp.strategy:DataParallelStrategy"
DP_ON_CPU_WARNING = "'dp' is not supported on CPUs, hence setting `strategy='ddp'`."


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add(
        "ddp", _STRATEGY, description="DistributedDataParallel; re-runs the script for each extra local rank"
    )
    registrar.add(
        "ddp_spawn",
        _STRATEGY,
        description="DistributedDataParallel; runs `launch(fn)` in spawned processes",
        start_method="spawn",
    )
    registrar.add(
        "ddp_fork",
        _STRATEGY,
        description="DistributedDataParallel; runs `launch(fn)` in forked processes",
        start_method="fork",
    )
    registrar.add(
        "ddp_notebook",
        _STRATEGY,
        description="DistributedDataParallel for notebooks (forked processes)",
        start_method="fork",
    )
    registrar.add(
        "ddp_find_unused_parameters_true",
        _STRATEGY,
        description="ddp with find_unused_parameters=True (models whose forward skips parameters)",
        find_unused_parameters=True,
    )
    registrar.add(
        "ddp_find_unused_parameters_false",
        _STRATEGY,
        description="ddp with find_unused_parameters=False",
        find_unused_parameters=False,
    )
    registrar.add("dp", _DP_STRATEGY, description="torch.nn.DataParallel over the GPUs of one process (ddp on CPU)")


@hookimpl
def fabric_adjust_strategy(registry: Registry, strategy: str, accelerator: Any, num_devices: int, num_nodes: int) -> str | None:
    """``dp`` on the CPU becomes ``ddp``: ``DataParallel`` splits batches over GPUs, and a CPU has none to split over."""
    if strategy == "dp" and accelerator.device_type == "cpu":
        from fabric_core.utilities import rank_zero_warn

        rank_zero_warn(DP_ON_CPU_WARNING)
        return "ddp"
    return None


@hookimpl
def fabric_auto_strategy(
    registry: Registry, accelerator: Any, num_devices: int, num_nodes: int, interactive: bool
) -> str | None:
    """More than one device or node on CPU/CUDA: DDP (forked processes in a notebook, where no script exists)."""
    if accelerator.device_type not in ("cpu", "cuda"):
        return None
    if num_nodes > 1:
        return "ddp"
    if num_devices > 1:
        return "ddp_fork" if interactive else "ddp"
    return None


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_ddp": "library"}
