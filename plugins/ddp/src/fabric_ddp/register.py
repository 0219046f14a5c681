"""Registration hooks of fabric-ddp: names only, as import strings, so discovering them imports no torch.

The ``fabric.plugins`` entry point of this distribution points here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fabric_core.registry import Registrar, Registry

_DDP = "fabric_ddp.strategy:DDPStrategy"
_DP = "fabric_ddp.strategy:DataParallelStrategy"


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add(
        "ddp", _DDP, description="DistributedDataParallel; re-runs the script for each extra local rank"
    )
    registrar.add(
        "ddp_spawn",
        _DDP,
        description="DistributedDataParallel; runs `launch(fn)` in spawned processes",
        start_method="spawn",
    )
    registrar.add(
        "ddp_fork",
        _DDP,
        description="DistributedDataParallel; runs `launch(fn)` in forked processes",
        start_method="fork",
    )
    registrar.add(
        "ddp_notebook",
        _DDP,
        description="DistributedDataParallel for notebooks (forked processes)",
        start_method="fork",
    )
    registrar.add(
        "ddp_find_unused_parameters_true",
        _DDP,
        description="ddp with find_unused_parameters=True (models whose forward skips parameters)",
        find_unused_parameters=True,
    )
    registrar.add(
        "ddp_find_unused_parameters_false",
        _DDP,
        description="ddp with find_unused_parameters=False",
        find_unused_parameters=False,
    )
    registrar.add("dp", _DP, description="torch.nn.DataParallel over the GPUs of one process (ddp on CPU)")


@hookimpl
def fabric_auto_strategy(
    registry: Registry, accelerator: Any, num_devices: int, num_nodes: int, interactive: bool
) -> str | None:
    """More than one device or node on CPU/CUDA: DDP (forked processes in a notebook, where no script exists)."""
    if getattr(accelerator, "device_type", None) not in ("cpu", "cuda"):
        return None
    if num_nodes > 1:
        return "ddp"
    if num_devices > 1:
        return "ddp_fork" if interactive else "ddp"
    return None
