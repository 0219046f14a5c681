"""Gradient accumulation over micro-batches: ``with fabric.accumulate(model, n) as step:``.

Each ``with`` block is one micro-batch. The first ``n - 1`` of every window run under the strategy's
``no_backward_sync`` (DDP skips its all-reduce, FSDP its reduce-scatter: gradients pile up locally); the ``n``-th
synchronises, and the block yields ``True`` there: time to ``optimizer.step()`` and ``zero_grad()``. Scale the loss
by ``1 / n`` (``fabric.backward(loss / n)``) and the gradients equal those of one step on the ``n`` micro-batches
together. A strategy without a way to skip synchronisation (DeepSpeed, whose engine reduces in its own backward)
synchronises every micro-batch: the gradients are the same, only the communication is not saved. DeepSpeed's own
``gradient_accumulation_steps`` stays DeepSpeed's: leave it at 1 when accumulating here (docs/decisions.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = ["accumulate"]

#: micro-batches seen in the current window, per set-up model
_seen: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@contextmanager
def accumulate(fabric: Any, module: Any, steps: int) -> Generator[bool, None, None]:
    """One micro-batch of a window of ``steps``; yields whether it is the window's last (gradients synchronised)."""
    from fabric_core.wrappers import FabricModule, unwrap_compiled

    if isinstance(steps, bool) or not isinstance(steps, int):  # bad types are TypeErrors (docs/decisions.md)
        raise TypeError(
            f"`fabric.accumulate(model, steps)` needs a whole number of micro-batches (an int), got"
            f" {type(steps).__name__} {steps!r}."
        )
    if steps < 1:
        raise ValueError(f"`fabric.accumulate(model, steps)` needs a positive number of micro-batches, got {steps!r}.")
    module, _ = unwrap_compiled(module)
    if not isinstance(module, FabricModule):
        raise TypeError(
            "`fabric.accumulate(model, steps)` needs the model returned by `fabric.setup(...)`, got a"
            f" {type(module).__name__}: `model, optimizer = fabric.setup(model, optimizer)` first."
        )
    seen = _seen.get(module, 0) + 1
    last = seen >= steps
    _seen[module] = 0 if last else seen
    control = fabric.strategy.backward_sync_control
    skip = nullcontext() if last or control is None else control.no_backward_sync(module.strategy_module, True)
    with skip:
        yield last
