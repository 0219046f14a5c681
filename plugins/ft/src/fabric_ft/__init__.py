"""fabric-ft: fault tolerance as an axis. Replica groups coordinated by torchft around the strategy inside each group
(``ft_ddp``: one process per group; ``ft_fsdp``: FSDP2 inside, HSDP; ``FaultTolerant(name, ...)`` for any other), every
step synchronous or semi-synchronous (LocalSGD, DiLoCo).

Importing this package is cheap; the strategies live in :mod:`fabric_ft.strategy` and are imported when a name is
first resolved or a class is touched here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_ft.strategy import FaultTolerant, FTDDPStrategy

__all__ = ["FTDDPStrategy", "FaultTolerant"]

__getattr__, __dir__ = lazy_exports(
    __name__, "fabric-ft", {"FTDDPStrategy": "fabric_ft.strategy", "FaultTolerant": "fabric_ft.strategy"}
)
