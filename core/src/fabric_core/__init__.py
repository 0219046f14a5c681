"""fabric-core: keep your PyTorch training loop, switch device, strategy and precision by argument.

``from fabric_core import Fabric, seed_everything, is_wrapped`` is the public surface; plugins extend it
through the hooks in :mod:`fabric_core.hookspecs`.

The public names are imported on first access (PEP 562), so importing a light submodule such as
``fabric_core.hookspecs`` or the ``fabric`` CLI does not pay for ``import torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.fabric import Fabric
    from fabric_core.utilities.seed import seed_everything
    from fabric_core.wrappers import is_wrapped

__all__ = ["Fabric", "is_wrapped", "seed_everything"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {"Fabric": "fabric_core.fabric", "seed_everything": "fabric_core.utilities.seed", "is_wrapped": "fabric_core.wrappers"},
)
