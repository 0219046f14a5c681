"""Exception types shared across fabric-core and its plugins.

:class:`MisconfigurationException` is the type the well-known Fabric raises for several configuration errors
(GPU ids, ...). Code written against it (``except MisconfigurationException``, ``pytest.raises(...)``) keeps
working here: where the reference raises it, we raise a subclass that *also* inherits from the builtin type we
raised before, so ``except ValueError`` (or ``RuntimeError``) keeps working too.

Only the standard library is imported here, so any module may raise these cheaply.
"""

from __future__ import annotations


class MisconfigurationException(Exception):
    """The arguments given to Fabric (or to one of its plugins) contradict each other or the machine."""


class DeviceIdError(MisconfigurationException, ValueError):
    """``devices=`` names device indices that cannot be used: duplicates, or indices this machine lacks."""


class NoDevicesAvailableError(MisconfigurationException, RuntimeError):
    """Devices of an accelerator were requested, but this machine has none of them."""


__all__ = ["DeviceIdError", "MisconfigurationException", "NoDevicesAvailableError"]
