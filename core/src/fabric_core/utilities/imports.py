"""Callables given by value or by name, for strategies that take code from their user (``parallelize_fn``, ...).

A strategy object built by the user receives the function itself. A strategy registered by name is built by the
registry as ``target(**init_kwargs)``, from values fixed at registration, and may be sent to spawned processes: there
the function is named by an import string ``"package.module:function"``, which :func:`load_callable` resolves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(value: Any, argument: str) -> Callable[..., Any]:
    """``value`` itself when callable; for ``"package.module:attribute"`` the object it names (which must be
    callable); a ``TypeError`` or ``ImportError`` naming ``argument`` otherwise."""
    if callable(value):
        return value
    if not isinstance(value, str) or ":" not in value:
        raise TypeError(
            f"`{argument}` must be a callable or an import string 'package.module:function', got {value!r}."
        )
    module_name, _, attribute = value.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"`{argument}={value!r}` names nothing importable: {type(err).__name__}: {err}") from err
    if not callable(obj):
        raise TypeError(f"`{argument}={value!r}` names {type(obj).__name__} object, which is not callable.")
    return obj
