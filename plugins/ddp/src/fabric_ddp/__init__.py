"""fabric-ddp: ``strategy="ddp"`` and friends for fabric-core.

Importing this package is cheap; the strategies live in :mod:`fabric_ddp.strategy` and are imported when a
name is first resolved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["DDPStrategy", "DataParallelStrategy"]

if TYPE_CHECKING:
    from fabric_ddp.strategy import DataParallelStrategy, DDPStrategy


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fabric_ddp import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'fabric_ddp' has no attribute {name!r}")
