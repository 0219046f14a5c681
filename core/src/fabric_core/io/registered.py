"""A registered checkpoint format as the resolver hands it to every strategy.

In a module of its own, apart from :mod:`fabric_core.io.format`: constructing a ``Fabric`` builds one per
registration, and should not import the format machinery (locations, the state walk) before anything is saved or
loaded (tests/core/test_import_budget.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabric_core.io.format import CheckpointFormat
    from fabric_core.io.location import CheckpointLocation


@dataclass(frozen=True)
class RegisteredFormat:
    """A checkpoint format an installed plugin registered (``fabric_register_checkpoint_formats``), as the resolver
    hands it to every strategy: asked directly whether it recognises a checkpoint, built only when its cheap check
    says yes (its module imported then, not before)."""

    name: str
    #: the registration's cheap ``location -> bool`` (``recognised_by``); ``True`` when it has none
    may_recognise: Callable[[CheckpointLocation], bool]
    #: builds the format with its registered ``init_kwargs``
    create: Callable[[], CheckpointFormat]

    def recognising(self, location: CheckpointLocation) -> CheckpointFormat | None:
        """The format, built, when a complete checkpoint of it is at ``location``; else ``None``."""
        if not self.may_recognise(location):
            return None
        candidate = self.create()
        return candidate if candidate.recognises(location) else None
