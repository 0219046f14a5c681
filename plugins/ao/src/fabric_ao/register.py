"""Registration hooks of fabric-ao: names only, neither ``torch`` nor ``torchao`` imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_FLOAT8 = "fabric_ao.precision:Float8Precision"
_TE = "fabric_ao.transformer_engine:TransformerEnginePrecision"


@hookimpl
def fabric_register_precisions(registrar: Registrar) -> None:
    registrar.add(
        "float8",
        _FLOAT8,
        description="float8 matmuls in Linear layers (torchao, tensorwise scales; emulated without a float8 GPU)",
        recipe="tensorwise",
    )
    registrar.add(
        "float8-rowwise",
        _FLOAT8,
        description="float8 matmuls in Linear layers (torchao, rowwise scales; emulated without a float8 GPU)",
        recipe="rowwise",
    )
    registrar.add(
        "transformer-engine",
        _TE,
        description="NVIDIA Transformer Engine float8, bfloat16 weights (needs transformer_engine and CUDA)",
        weights_dtype="bfloat16",
    )
    registrar.add(
        "transformer-engine-float16",
        _TE,
        description="NVIDIA Transformer Engine float8, float16 weights (needs transformer_engine and CUDA)",
        weights_dtype="float16",
    )


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_ao": "library", "torchao": "library", "transformer_engine": "library"}


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin (its dependency), installed or not."""
    return ["torchao"]
