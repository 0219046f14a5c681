"""fabric-ddp: ``strategy="ddp"`` and friends for fabric-core.

Importing this package is cheap; the strategies live in :mod:`fabric_ddp.strategy` and are imported when a
name is first resolved or a class is touched here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_ddp.strategy import DataParallelStrategy, DDPStrategy

__all__ = ["DDPStrategy", "DataParallelStrategy"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-ddp",
    {"DDPStrategy": "fabric_ddp.strategy", "DataParallelStrategy": "fabric_ddp.strategy"},
)
