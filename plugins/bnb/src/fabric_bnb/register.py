"""Registration hooks of fabric-bnb: names only, neither ``torch`` nor ``bitsandbytes`` imported.

``precision="bnb-nf4"`` is ``BitsandbytesPrecision(mode="nf4")``; the spelling of an LLM library's
``--quantize bnb.nf4`` is a silent alias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_PRECISION = "fabric_bnb.precision:BitsandbytesPrecision"
_MODES = {
    "nf4": "4-bit NormalFloat Linear weights (QLoRA), bitsandbytes",
    "nf4-dq": "4-bit NormalFloat Linear weights, double-quantized statistics, bitsandbytes",
    "fp4": "4-bit float Linear weights, bitsandbytes",
    "fp4-dq": "4-bit float Linear weights, double-quantized statistics, bitsandbytes",
    "int8": "frozen int8 Linear weights (LLM.int8), float16 elsewhere, bitsandbytes",
    "int8-training": "trainable float16 Linear weights, int8 matmuls, bitsandbytes",
}


@hookimpl
def fabric_register_precisions(registrar: Registrar) -> None:
    for mode, description in _MODES.items():
        registrar.add(f"bnb-{mode}", _PRECISION, description=description, aliases={f"bnb.{mode}": None}, mode=mode)


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_bnb": "library", "bitsandbytes": "library"}


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin (its dependency), installed or not."""
    return ["bitsandbytes"]
