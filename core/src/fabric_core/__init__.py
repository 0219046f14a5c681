"""fabric-core: keep your PyTorch training loop, switch device, strategy and precision by argument.

``from fabric_core import Fabric, seed_everything, is_wrapped`` is the public surface; plugins extend it
through the hooks in :mod:`fabric_core.hookspecs`.
"""

from fabric_core.fabric import Fabric
from fabric_core.utilities.seed import seed_everything
from fabric_core.wrappers import is_wrapped

__all__ = ["Fabric", "is_wrapped", "seed_everything"]
__version__ = "0.1.0"
