"""One training step's forward and backward over micro-batches, as ``fabric.forward_backward`` hands it to a strategy.

Most strategies run a step as the user's loop would: each micro-batch through the model's forward, the loss, and
``fabric.backward`` of its share (:meth:`ForwardBackward.run`). A strategy that must see forward and backward
together overrides :meth:`~fabric_core.strategies.Strategy.forward_backward`: a pipeline runs its schedule over the
micro-batches instead, a sequence-parallel strategy shards the inputs along the sequence before calling ``run``.
So the loop is the same whatever the strategy::

    loss = fabric.forward_backward(model, x, target=y, loss_fn=F.cross_entropy, micro_batches=4)
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor
from torch.nn import Module

from fabric_core.utilities.apply import apply_to_collection

__all__ = ["ForwardBackward", "batch_size", "check_micro_batches", "split_micro_batches"]

#: ``loss_fn(output, target) -> loss`` (``loss_fn(output)`` when no target is given).
LossFn = Callable[..., Tensor]


def batch_size(obj: Any) -> int | None:
    """The size of the first dimension shared by the tensors in ``obj`` (``None`` without tensors); ``ValueError``
    when they disagree."""
    sizes: set[int] = set()
    apply_to_collection(obj, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() else None)
    if len(sizes) > 1:
        raise ValueError(
            f"The inputs of `fabric.forward_backward` have different batch sizes {sorted(sizes)} in their first"
            " dimension; micro-batches are cut from that dimension, so every tensor input (and the target) must"
            " have the same one."
        )
    return next(iter(sizes), None)


def split_micro_batches(obj: Any, micro_batches: int) -> list[Any]:
    """``obj`` (tensors in any collection) cut into ``micro_batches`` equal parts along the first dimension; other
    values are the same in every part. ``ValueError`` when the batch does not divide evenly: uneven micro-batches
    would weigh samples differently than the whole batch does."""
    size = batch_size(obj)
    if size is not None and size % micro_batches:
        raise ValueError(
            f"`fabric.forward_backward` cuts the batch into `micro_batches={micro_batches}` equal parts, but the batch"
            f" has {size} samples. Use a batch size divisible by {micro_batches} (e.g."
            f" {max(micro_batches, size - size % micro_batches)}), or change `micro_batches`."
        )
    if micro_batches == 1:
        return [obj]
    parts: list[Any] = []
    for index in range(micro_batches):
        parts.append(apply_to_collection(obj, Tensor, lambda t, i=index: t.chunk(micro_batches)[i] if t.dim() else t))
    return parts


@dataclass
class ForwardBackward:
    """One call of ``fabric.forward_backward``: what a strategy receives in
    :meth:`~fabric_core.strategies.Strategy.forward_backward`.

    ``module`` is the plain module the strategy set up (what ``setup_module`` returned); ``args``/``kwargs`` the
    model's inputs for the whole batch; ``target`` the loss's second argument (``None``: ``loss_fn(output)``).
    ``forward``, ``backward`` and ``no_backward_sync`` are Fabric's (the set-up model's call with the precision's
    casting, ``fabric.backward``, ``fabric.no_backward_sync(model, enabled)``), so :meth:`run` is exactly the loop a
    user would write.
    """

    module: Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    target: Any
    loss_fn: LossFn
    micro_batches: int | None
    forward: Callable[..., Any] = field(repr=False)
    backward: Callable[[Tensor], None] = field(repr=False)
    no_backward_sync: Callable[[bool], Any] = field(repr=False, default=lambda enabled: nullcontext())

    def loss(self, output: Any, target: Any) -> Tensor:
        """``loss_fn(output, target)``, or ``loss_fn(output)`` without a target; refused unless it is one number."""
        loss = self.loss_fn(output) if target is None else self.loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                "The `loss_fn` passed to `fabric.forward_backward` must return the loss as a tensor with one element"
                f" (reduce it, e.g. its mean), got {type(loss).__name__}"
                f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, Tensor) else ''}."
            )
        return loss

    @staticmethod
    def split(obj: Any, micro_batches: int) -> list[Any]:
        """``obj`` cut into ``micro_batches`` equal parts along the first dimension (:func:`split_micro_batches`):
        what a strategy running its own micro-batches uses, with the same refusal of a batch that does not divide."""
        return split_micro_batches(obj, micro_batches)

    def with_inputs(self, **changes: Any) -> ForwardBackward:
        """A copy with some fields replaced (inputs sharded, another loss function): how a strategy adapts the step
        before :meth:`run`."""
        return replace(self, **changes)

    def run(self) -> Tensor:
        """The default step: each micro-batch through ``forward``, ``loss_fn``, and ``backward(loss /
        micro_batches)``; gradients synchronise on the last micro-batch only. Returns the mean of the micro-batch
        losses, detached: the whole batch's loss when ``loss_fn`` averages over samples."""
        n = self.micro_batches or 1
        inputs = split_micro_batches((self.args, dict(self.kwargs), self.target), n)
        total: Tensor | None = None
        for index, (args, kwargs, target) in enumerate(inputs):
            with self.no_backward_sync(index < n - 1) if n > 1 else nullcontext():
                loss = self.loss(self.forward(*args, **kwargs), target)
                self.backward(loss / n if n > 1 else loss)
            value = loss.detach()
            total = value if total is None else total + value
        assert total is not None
        return total / n if n > 1 else total


def check_micro_batches(micro_batches: Any) -> int | None:
    """``micro_batches`` as given when it is ``None`` or a positive ``int``, else ``ValueError``."""
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1):
        raise ValueError(f"`micro_batches` must be a positive integer, got {micro_batches!r}.")
    return micro_batches
