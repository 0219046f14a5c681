"""fabric-deepspeed: DeepSpeed ZeRO training for fabric-core, on GPUs and on the CPU.

``Fabric(strategy="deepspeed_stage_3")`` works once this distribution is installed; the classes are importable from
here for users who configure them (``DeepSpeedStrategy(config="ds_config.json")``). Imports are lazy, so discovering
the plugin never imports deepspeed: that happens when a DeepSpeed strategy sets up its processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_deepspeed.checkpoint import load_deepspeed_checkpoint
    from fabric_deepspeed.precision import DeepSpeedPrecision
    from fabric_deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedPrecision", "DeepSpeedStrategy", "load_deepspeed_checkpoint"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-deepspeed",
    {
        "DeepSpeedStrategy": "fabric_deepspeed.strategy",
        "DeepSpeedPrecision": "fabric_deepspeed.precision",
        "load_deepspeed_checkpoint": "fabric_deepspeed.checkpoint",
    },
)
