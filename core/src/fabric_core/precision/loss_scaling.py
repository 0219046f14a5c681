"""Loss scaling for float16 precisions, once for every plugin that keeps a gradient scaler.

A precision that scales the loss (fabric-amp's ``16-mixed`` with ``torch.amp.GradScaler``, fabric-fsdp's with
``ShardedGradScaler``) must do the same five things in Fabric's loop: scale the loss in ``fabric.backward``,
unscale each optimizer's gradients at most once before its step (clipping may come first, and a scaler refuses a
second ``unscale_``), step through the scaler so that a step with inf/NaN gradients is skipped, update the scale,
and save/restore the scaler's state. :class:`LossScaling` does them for any object with the ``GradScaler``
interface held in ``self.scaler`` (``None``: no scaling, every method passes through).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from fabric_core.utilities.rank_zero import rank_zero_warn

__all__ = ["LossScaling"]


class LossScaling:
    """Mixin for a :class:`~fabric_core.precision.Precision` that keeps a gradient scaler in ``self.scaler``.

    Put it before ``Precision`` in the bases; ``self.precision`` names the precision in messages.
    """

    scaler: Any = None
    precision: str

    @property
    def _unscaled(self) -> set[int]:
        """Ids of the optimizers whose gradients were unscaled since their last step."""
        unscaled = self.__dict__.get("_fabric_unscaled")
        if unscaled is None:
            unscaled = self.__dict__["_fabric_unscaled"] = set()
        return unscaled

    def pre_backward(self, tensor: Tensor, module: Module | None) -> Tensor:
        """Scale the loss, so small float16 gradients do not flush to zero."""
        if self.scaler is not None:
            return self.scaler.scale(tensor)
        return tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        if kwargs.get("closure") is not None:
            raise TypeError(
                f"Loss scaling (`precision={self.precision!r}`) does not support `optimizer.step(closure)`: the"
                " gradient scaler must check the gradients between backward and step. Call"
                " `fabric.backward(loss)` before `optimizer.step()`, or use `precision='bf16-mixed'`."
            )
        # Unscales (unless clipping already did), skips the step if any gradient is inf/NaN.
        output = self.scaler.step(optimizer, **kwargs)
        # Lower the scale after a skipped step, raise it after `growth_interval` good ones.
        self.scaler.update()
        self._unscaled.clear()  # update() reset the scaler's per-optimizer state
        return output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide the gradients of ``optimizer`` by the loss scale, at most once between two steps."""
        if self.scaler is None:
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            raise NotImplementedError("Gradient clipping is not implemented for optimizers handling the unscaling.")
        if id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.scaler is None:
            rank_zero_warn(
                f"The checkpoint holds loss-scaler state (saved with `precision='16-mixed'`), but this run uses"
                f" `precision={self.precision!r}`, which has no scaler; the state is ignored."
            )
            return
        self.scaler.load_state_dict(state_dict)
        self._unscaled.clear()
