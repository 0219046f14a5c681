"""Rank-zero gating for prints, warnings and logger writes.

The rank is read from the environment at import (RANK, LOCAL_RANK, SLURM_PROCID, JSM_NAMESPACE_RANK) and
updated by parallel strategies once their process group knows the real rank.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

#: The ``fabric_core`` logger: every rank writes through it (the rank-zero gate is :func:`rank_zero_info`'s).
fabric_log = logging.getLogger("fabric_core")

T = TypeVar("T")


def _rank_from_env() -> int:
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


class _RankHolder:
    rank: int = _rank_from_env()


def get_rank() -> int:
    return _RankHolder.rank


def set_rank(rank: int) -> None:
    _RankHolder.rank = int(rank)


def rank_zero_only(fn: Callable[..., T], default: Any = None) -> Callable[..., T | Any]:
    """Run ``fn`` on global rank 0 only; other ranks get ``default``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T | Any:
        if _RankHolder.rank == 0:
            return fn(*args, **kwargs)
        return default

    return wrapped


class PossibleUserWarning(UserWarning):
    """A warning about something that is probably, but not certainly, a mistake."""


def rank_prefixed_message(message: str) -> str:
    """``"[rank: R] message"`` when this process knows it is one rank of several (a rank variable is set or a
    strategy told it its rank), else the message alone, as a plain single process shows it."""
    if any(key in os.environ for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")):
        return f"[rank: {_RankHolder.rank}] {message}"
    return message


def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    if _RankHolder.rank == 0:
        warnings.warn(message, category, stacklevel=stacklevel)


def rank_zero_info(message: str) -> None:
    if _RankHolder.rank == 0:
        fabric_log.info(message)
