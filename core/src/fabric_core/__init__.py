"""fabric-core: keep your PyTorch training loop, switch device, strategy and precision by argument.

``from fabric_core import Fabric, seed_everything, is_wrapped`` is the public surface; plugins extend it
through the hooks in :mod:`fabric_core.hookspecs`.

The public names are imported on first access (PEP 562), so importing a light submodule such as
``fabric_core.hookspecs`` or the ``fabric`` CLI does not pay for ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.fabric import Fabric
    from fabric_core.utilities.seed import seed_everything
    from fabric_core.wrappers import is_wrapped

__all__ = ["Fabric", "is_wrapped", "seed_everything"]
__version__ = "0.1.0"

_LAZY = {
    "Fabric": "fabric_core.fabric",
    "seed_everything": "fabric_core.utilities.seed",
    "is_wrapped": "fabric_core.wrappers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
