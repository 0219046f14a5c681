"""fabric-bnb: bitsandbytes quantization (``BitsandbytesPrecision``, ``precision="bnb-nf4"``, ...) for fabric-core.

Importing this package is cheap (the registration module is imported while plugins are discovered);
bitsandbytes is imported when a precision is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.utilities import lazy_exports

if TYPE_CHECKING:
    from fabric_bnb.precision import BitsandbytesPrecision

__all__ = ["BitsandbytesPrecision"]

__getattr__, __dir__ = lazy_exports(__name__, "fabric-bnb", {"BitsandbytesPrecision": "fabric_bnb.precision"})
