"""fabric-ft: ``strategy="ft_ddp"``, fault-tolerant data parallelism over replica groups with torchft.

Importing this package is cheap; the strategy lives in :mod:`fabric_ft.strategy` and is imported when the name is
first resolved or the class is touched here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_ft.strategy import FTDDPStrategy

__all__ = ["FTDDPStrategy"]

__getattr__, __dir__ = lazy_exports(__name__, "fabric-ft", {"FTDDPStrategy": "fabric_ft.strategy"})
