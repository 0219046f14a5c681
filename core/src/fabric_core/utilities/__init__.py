"""Small helpers shared by the facade and by plugins (no heavy imports here).

The names the well-known Fabric exports from its ``utilities`` package are importable from here too, each loaded on
first access (so ``import fabric_core.utilities.<module>`` stays as cheap as the module itself). ``Throughput``,
``ThroughputMonitor`` and ``measure_flops`` are :mod:`fabric_core.runtime.throughput`'s, ``RunInfo``
:mod:`fabric_core.runtime.run`'s, ``goodput_section`` and ``count_step_as`` (what a strategy tells the goodput
ledger, e.g. fabric-ft's quorum changes) :mod:`fabric_core.runtime.goodput`'s, handed on by name only:
``utilities`` is the ground floor and imports nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.utilities.apply import apply_to_collection, move_data_to_device
    from fabric_core.utilities.object_collectives import all_gather_object
    from fabric_core.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
    from fabric_core.utilities.seed import seed_everything
    from fabric_core.utilities.warnings import disable_possible_user_warnings

__all__ = [
    "DataCursor",
    "GlobalOrderSampler",
    "MisconfigurationException",
    "RunInfo",
    "Step",
    "Throughput",
    "ThroughputMonitor",
    "all_gather_object",
    "apply_to_collection",
    "clip_grad_norm",
    "count_step_as",
    "disable_possible_user_warnings",
    "fabric_log",
    "get_rank",
    "goodput_section",
    "guarded",
    "import_package",
    "lazy_exports",
    "load_callable",
    "measure_flops",
    "missing_package",
    "move_data_to_device",
    "on_failure",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "seed_everything",
    "set_rank",
    "shard_full_tensors_on_load",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "DataCursor": "fabric_core.utilities.global_order",
        "GlobalOrderSampler": "fabric_core.utilities.global_order",
        "Step": "fabric_core.utilities.global_order",
        "RunInfo": "fabric_core.runtime.run",
        "Throughput": "fabric_core.runtime.throughput",
        "ThroughputMonitor": "fabric_core.runtime.throughput",
        "count_step_as": "fabric_core.runtime.goodput",
        "goodput_section": "fabric_core.runtime.goodput",
        "measure_flops": "fabric_core.runtime.throughput",
        "apply_to_collection": "fabric_core.utilities.apply",
        "move_data_to_device": "fabric_core.utilities.apply",
        "all_gather_object": "fabric_core.utilities.object_collectives",
        "clip_grad_norm": "fabric_core.utilities.dtensor",
        "shard_full_tensors_on_load": "fabric_core.utilities.dtensor",
        "MisconfigurationException": "fabric_core.utilities.exceptions",
        "guarded": "fabric_core.utilities.exceptions",
        "on_failure": "fabric_core.utilities.exceptions",
        "import_package": "fabric_core.utilities.imports",
        "load_callable": "fabric_core.utilities.imports",
        "missing_package": "fabric_core.utilities.imports",
        "lazy_exports": "fabric_core.utilities.lazy",
        "get_rank": "fabric_core.utilities.rank_zero",
        "set_rank": "fabric_core.utilities.rank_zero",
        "fabric_log": "fabric_core.utilities.rank_zero",
        "rank_zero_info": "fabric_core.utilities.rank_zero",
        "rank_zero_only": "fabric_core.utilities.rank_zero",
        "rank_zero_warn": "fabric_core.utilities.rank_zero",
        "seed_everything": "fabric_core.utilities.seed",
        "disable_possible_user_warnings": "fabric_core.utilities.warnings",
    },
    submodules=("data", "dtensor", "global_order", "seed"),
)
