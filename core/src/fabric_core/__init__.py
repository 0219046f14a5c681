"""fabric-core: keep your PyTorch training loop, switch device, strategy and precision by argument.

``from fabric_core import Fabric, seed_everything, is_wrapped`` is the public surface; plugins extend it
through the hooks in :mod:`fabric_core.plugins.hookspecs`.

The public names are imported on first access (PEP 562), so importing a light submodule such as
``fabric_core.plugins.hookspecs`` or the ``fabric`` CLI does not pay for ``import torch``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabric_core.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric_core.fabric import Fabric
    from fabric_core.utilities.seed import seed_everything
    from fabric_core.utilities.warnings import disable_possible_user_warnings
    from fabric_core.wrappers import is_wrapped

__all__ = ["Fabric", "disable_possible_user_warnings", "is_wrapped", "seed_everything"]

# Info messages ("Seed set to 42", "Using bfloat16 Automatic Mixed Precision (AMP)", "Initializing distributed: ...")
# are shown by default, as the well-known implementation shows them: the library logger logs at INFO, and when the
# application has configured no logging at all it gets its own stderr handler. An application that configures
# logging keeps full control (the messages then propagate to its handlers).
_log = logging.getLogger(__name__)
_log.setLevel(logging.INFO)
if not logging.getLogger().handlers and not _log.handlers:
    _log.addHandler(logging.StreamHandler())
    _log.propagate = False

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "Fabric": "fabric_core.fabric",
        "seed_everything": "fabric_core.utilities.seed",
        "is_wrapped": "fabric_core.wrappers",
        "disable_possible_user_warnings": "fabric_core.utilities.warnings",
    },
)

from fabric_core.utilities.warnings import apply_environment as _apply_warning_settings  # noqa: E402 (stdlib only)

_apply_warning_settings()
