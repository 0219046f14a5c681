"""Registration hooks of fabric-amp: names only, no ``torch`` import.

``precision=16`` reaches the registry as the string ``"16"``, so the legacy int, ``"16"`` and ``"bf16"``
are aliases that warn (they are ambiguous next to ``16-true``/``bf16-true``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar

_PRECISION = "fabric_amp.precision:MixedPrecision"


def _legacy_warning(alias: str, canonical: str) -> str:
    return (
        f"`precision={alias}` is supported for historical reasons but its usage is discouraged."
        f" Please set your precision to {canonical} instead!"
    )


@hookimpl
def fabric_register_precisions(registrar: Registrar) -> None:
    registrar.add(
        "16-mixed",
        _PRECISION,
        description="float32 weights, float16 autocast + loss scaling (bf16-mixed on CPU)",
        aliases={"16": _legacy_warning("16", "16-mixed")},
        precision="16-mixed",
    )
    registrar.add(
        "bf16-mixed",
        _PRECISION,
        description="float32 weights, bfloat16 autocast",
        aliases={"bf16": _legacy_warning("bf16", "bf16-mixed")},
        precision="bf16-mixed",
    )


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_amp": "library"}
