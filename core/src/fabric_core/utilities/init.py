"""Model-construction helpers for ``fabric.init_module(empty_init=True)``."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode


class SkipParameterInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls while a model is built, when the weights will be loaded anyway.

    Building a large model spends most of its time in random initialisation; with ``empty_init=True`` the
    parameters keep whatever memory they were allocated with (or stay on the meta device) and a checkpoint
    fills them in later.
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
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs.get("tensor", args[0] if args else None)
        return func(*args, **kwargs)
