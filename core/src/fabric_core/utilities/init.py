"""Model-construction helpers for ``fabric.init_module(empty_init=True)``."""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

_INIT_MODULE = "torch.nn.init"
# Frames that may sit between a torch.nn.init function and this mode (Python-level dispatch helpers).
_DISPATCH_MODULES = ("torch.overrides", "torch._tensor", "torch.utils._device")
_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
)


class SkipParameterInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls while a model is built, when the weights will be loaded anyway.

    Building a large model spends most of its time in random initialisation; with ``empty_init=True`` the
    parameters keep whatever memory they were allocated with (or stay on the meta device) and a checkpoint
    fills them in later.

    Only some ``torch.nn.init`` functions dispatch through torch functions themselves (``uniform_``,
    ``normal_``, ``constant_``, ``kaiming_uniform_``); those are skipped whole. The others (``xavier_uniform_``
    used by attention layers, ``trunc_normal_``, ``ones_``/``zeros_`` used by norms, ...) are plain Python that
    writes into the tensor in place, so writes into that tensor made from inside ``torch.nn.init`` are dropped.
    """

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __enter__(self) -> SkipParameterInit:
        if self.enabled:
            super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == _INIT_MODULE:
            return kwargs.get("tensor", args[0] if args else None)
        target = _init_target(sys._getframe(1))
        if target is not None:
            written = _written_tensor(func, args, kwargs)
            if written is not None and _shares_memory(written, target):
                return None if getattr(func, "__name__", "") == "__setitem__" else written
        return func(*args, **kwargs)


def _init_target(frame: Any) -> Tensor | None:
    """The tensor a ``torch.nn.init`` function is initialising, when ``frame`` (the op's caller) is one."""
    for _ in range(4):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__")
        if module == _INIT_MODULE:
            tensor = frame.f_locals.get("tensor")
            return tensor if isinstance(tensor, Tensor) else None
        if module not in _DISPATCH_MODULES:
            return None
        frame = frame.f_back
    return None


def _written_tensor(func: Any, args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor an op writes into: ``out=``, or ``self`` of an in-place op (``x.fill_()``, ``x[i] = v``)."""
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or name in _IN_PLACE_DUNDERS
    if in_place and args and isinstance(args[0], Tensor):
        return args[0]
    return None


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return a is b
