"""The precision contract. The base class is full-precision (``32-true``) and does nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.utilities.apply import apply_to_collection


class Precision:
    """Base class for precision plugins; as it is, ``32-true``.

    Strategies call these methods at fixed points: ``convert_module`` in setup, ``module_init_context`` /
    ``tensor_init_context`` for ``fabric.init_module()``/``init_tensor()``, ``forward_context`` around the
    wrapped forward (and ``fabric.autocast()``), ``convert_input``/``convert_output`` around it,
    ``pre_backward``/``backward``/``post_backward`` in ``fabric.backward``, ``optimizer_step`` in
    ``optimizer.step()``, ``unscale_gradients`` before clipping.
    """

    #: canonical name, e.g. ``"32-true"``.
    precision: str = "32-true"

    #: ``True`` for a precision that only rewrites the model's modules (``convert_module``,
    #: ``module_init_context``) and may act after ``optimizer_step``, and otherwise behaves as ``32-true`` (no
    #: dtype, autocast, input casting or backward of its own): float8 training that swaps Linear layers, for
    #: example. A strategy that needs its own precision type may accept such a precision, since the two do not
    #: compete over the model's dtypes (docs/decisions.md, "Module-transforming precisions").
    transforms_modules_only: bool = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this precision cannot run on this machine (a missing package or device, and how to get it), or
        ``None``. Cheap and import-free where possible: ``fabric plugins --check`` shows it as ``unavailable: ...``
        (as a reserved name whose distribution is absent shows its install line). Default: ``None``."""
        return None

    def configure(self, device_type: str) -> None:
        """Told once which device type the run uses (autocast needs it). Default: nothing to do."""

    # ---------------------------------------------------------------------------------------- module and init
    def convert_module(self, module: Module) -> Module:
        """Called by the facade in ``fabric.setup``/``setup_module`` with the plain module, before the strategy sees
        it; returns the module to set up (cast in place for the true-precision types). Nothing here."""
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        """Entered by ``fabric.init_tensor()``: tensors made inside get this precision's dtype. Nothing here."""
        return nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        """Entered by ``fabric.init_module()``: parameters made inside get this precision's dtype. Nothing here."""
        return nullcontext()

    def forward_context(self) -> AbstractContextManager:
        """Entered around every forward of a set-up module and by ``fabric.autocast()`` (autocast for mixed
        precision). Nothing here."""
        return nullcontext()

    # ---------------------------------------------------------------------------------------- data in and out
    #: dtype floating inputs are cast to before forward (``None``: leave them).
    input_dtype: torch.dtype | None = None

    def convert_input(self, data: Any) -> Any:
        """The forward's arguments (any collection), floating tensors cast to :attr:`input_dtype` when it is set."""
        if self.input_dtype is None:
            return data
        return _cast_floating(data, self.input_dtype)

    def convert_output(self, data: Any) -> Any:
        """The forward's result, floating tensors cast back to torch's default dtype when inputs were cast."""
        if self.input_dtype is None:
            return data
        return _cast_floating(data, torch.get_default_dtype())

    # ---------------------------------------------------------------------------------------- backward / step
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Tensor:
        """``fabric.backward``, first: the loss to differentiate (scaled, under loss scaling); ``module`` is the
        plain module or ``None``."""
        return tensor

    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward``: run the backward pass of ``tensor`` (what :meth:`pre_backward` returned)."""
        tensor.backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Module | None) -> Tensor:
        """``fabric.backward``, last; returns the tensor."""
        return tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` of the plain optimizer (skipped on inf/NaN gradients under loss scaling); returns the
        step's result."""
        return optimizer.step(**kwargs)

    def main_params(self, optimizer: Optimizer) -> Any:
        """The parameters whose gradients clipping acts on (the optimizer's, here)."""
        for group in optimizer.param_groups:
            yield from group["params"]

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients back to their true scale before clipping (loss-scaling precisions)."""

    @property
    def requires_fabric_backward(self) -> bool:
        """True when a plain ``loss.backward()`` would skip something this precision must do."""
        cls = type(self)
        return any(getattr(cls, n) is not getattr(Precision, n) for n in ("pre_backward", "backward", "post_backward"))

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What checkpoints store for this precision beside the model (a loss scaler's state); nothing here."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave, when a checkpoint is loaded."""

    def teardown(self) -> None:
        """Release what the precision holds, from ``strategy.teardown()``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return apply_to_collection(data, Tensor, cast)


class DefaultDtype:
    """Context manager that switches ``torch``'s default floating dtype and always restores it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._previous: list[torch.dtype] = []

    def __enter__(self) -> None:
        self._previous.append(torch.get_default_dtype())
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self._previous.pop())
