"""Warnings users can silence: :class:`PossibleUserWarning` and :func:`disable_possible_user_warnings`.

A ``PossibleUserWarning`` flags something that is probably, not certainly, a mistake (parameters on different
devices before ``setup``, ``no_backward_sync`` with a strategy that cannot skip the sync, an ``IterableDataset``
that every rank iterates whole). Once you know, silence them with ``disable_possible_user_warnings()`` or by
setting ``POSSIBLE_USER_WARNINGS=off`` (or ``0``) before importing ``fabric_core`` -- the variable and function
users of the well-known implementation know.
"""

from __future__ import annotations

import os
import warnings

from fabric_core.utilities.rank_zero import PossibleUserWarning

__all__ = ["PossibleUserWarning", "disable_possible_user_warnings"]

VARIABLE = "POSSIBLE_USER_WARNINGS"


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore every :class:`PossibleUserWarning` (or only those raised from modules matching ``module``)."""
    warnings.filterwarnings("ignore", module=module, category=PossibleUserWarning)


def apply_environment() -> None:
    """``POSSIBLE_USER_WARNINGS=off`` or ``0`` silences them for the whole process (read when fabric_core loads)."""
    if os.environ.get(VARIABLE, "").strip().lower() in ("0", "off"):
        disable_possible_user_warnings()
