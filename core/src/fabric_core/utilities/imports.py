"""Imports a plugin depends on: callables given by name, and the optional packages a plugin drives.

* :func:`load_callable`: a strategy object built by the user receives the function itself (``parallelize_fn``...);
  one registered by name is built by the registry as ``target(**init_kwargs)``, from values fixed at registration,
  and may be sent to spawned processes: there the function is named by an import string
  ``"package.module:function"``, which :func:`load_callable` resolves.
* :func:`missing_package` (what ``unavailable_reason`` answers, without importing anything) and
  :func:`import_package` (the import, or an error with the install line): one wording for every plugin whose
  framework is an optional package.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any


def missing_package(package: str, install: str, note: str = "") -> str | None:
    """``"needs the `package` package<note>: `install`"`` when ``package`` cannot be found, else ``None``; imports
    nothing (for ``Precision.unavailable_reason``, which ``fabric plugins --check`` shows)."""
    if importlib.util.find_spec(package) is None:
        return f"needs the `{package}` package{note}: `{install}`"
    return None


def import_package(module: str, user: str, install: str) -> ModuleType:
    """``module`` imported, or a ``ModuleNotFoundError`` saying that ``user`` (a phrase: ```precision='float8'```)
    needs its package and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ModuleNotFoundError(
            f"{user} needs the `{package}` package, which could not be imported ({err}). Install it with `{install}`."
        ) from err


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
