"""fabric-fsdp: fully sharded data parallel training (PyTorch FSDP2) for fabric-core.

``Fabric(strategy="fsdp")`` works once this distribution is installed; the classes are importable from here
for users who want to configure them (``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")``).
Imports are lazy so that discovering the plugin never pulls in ``torch.distributed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_fsdp.checkpoint import load_sharded_checkpoint
    from fabric_fsdp.model_parallel import ModelParallelStrategy
    from fabric_fsdp.precision import FSDPPrecision
    from fabric_fsdp.sequence import ulysses
    from fabric_fsdp.strategy import FSDPStrategy

__all__ = ["FSDPPrecision", "FSDPStrategy", "ModelParallelStrategy", "load_sharded_checkpoint", "ulysses"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-fsdp",
    {
        "FSDPStrategy": "fabric_fsdp.strategy",
        "ModelParallelStrategy": "fabric_fsdp.model_parallel",
        "FSDPPrecision": "fabric_fsdp.precision",
        "load_sharded_checkpoint": "fabric_fsdp.checkpoint",
        "ulysses": "fabric_fsdp.sequence",
    },
)
