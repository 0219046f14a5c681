"""Exception types shared across fabric-core and its plugins, and the two ways an error is handled without naming it.

:class:`MisconfigurationException` is the type the well-known Fabric raises for several configuration errors
(GPU ids, ...). Code written against it (``except MisconfigurationException``, ``pytest.raises(...)``) keeps
working here: where the reference raises it, we raise a subclass that *also* inherits from the builtin type we
raised before, so ``except ValueError`` (or ``RuntimeError``) keeps working too.

Everywhere else an error is caught by its type. Two situations cannot name one, and each has one helper, so the
project's broad ``except`` clauses are few and each says why (docs/decisions.md, "Broad excepts, counted"):

* :func:`on_failure`: clean up when a block fails for *any* reason (``KeyboardInterrupt`` included), and let the
  error go on: nothing is caught;
* :func:`guarded`: run code the caller does not control (a plugin's hook, a tracker's client, a user's property, a
  failure one rank must report to the others instead of raising alone) and get its error back as a value.

Only the standard library is imported here, so any module may use these cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class MisconfigurationException(Exception):
    """The arguments given to Fabric (or to one of its plugins) contradict each other or the machine."""


class DeviceIdError(MisconfigurationException, ValueError):
    """``devices=`` names device indices that cannot be used: duplicates, or indices this machine lacks."""


class NoDevicesAvailableError(MisconfigurationException, RuntimeError):
    """Devices of an accelerator were requested, but this machine has none of them."""


@contextmanager
def on_failure(cleanup: Callable[[], Any]) -> Iterator[None]:
    """Run ``cleanup()`` when the block raises anything (``KeyboardInterrupt`` and ``SystemExit`` too), then let the
    error propagate unchanged; nothing happens when the block completes."""
    done = False
    try:
        yield
        done = True
    finally:
        if not done:
            cleanup()


def guarded(function: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, Exception | None]:
    """``(function(*args, **kwargs), None)``, or ``(None, error)`` when it raised an ``Exception``.

    For code whose errors the caller cannot name and must not let escape: a plugin's hook or import (the failure is
    recorded against that plugin, the others go on), a tracker's client, a user's object, a rank's failure that the
    other ranks must hear about at a vote rather than wait for. The caller decides what the error means; it never
    passes silently. ``KeyboardInterrupt`` and ``SystemExit`` are not caught.
    """
    try:
        return function(*args, **kwargs), None
    except Exception as err:  # the callers' code may raise anything: the error is handed back, never dropped here
        return None, err


__all__ = ["DeviceIdError", "MisconfigurationException", "NoDevicesAvailableError", "guarded", "on_failure"]
