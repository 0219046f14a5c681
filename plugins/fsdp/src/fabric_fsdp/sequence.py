"""The sequence axis of ``model_parallel``: Ulysses sequence parallelism (DeepSpeed's), for any attention.

Every rank of the ``sequence`` mesh dimension holds ``1/sp`` of each sample's sequence. Outside attention the model
is token-wise, so each rank computes its slice alone; around attention an all-to-all trades heads for sequence, so
each rank attends over the *whole* sequence with ``1/sp`` of the heads, and a second all-to-all gives the heads back
(:func:`ulysses`). That works with any attention function, because the function sees ordinary full-length inputs.

Three things make a sequence-sharded step equal to the unsharded one, and
:meth:`~fabric_fsdp.model_parallel.ModelParallelStrategy.forward_backward` does all three:

* the inputs and the target are cut along the sequence (:func:`shard_sequence`), and positions are passed as
  ``position_ids`` (each rank's slice of ``0..S-1``), since positions the model computes itself would restart at 0;
* ``F.scaled_dot_product_attention`` calls inside the model go through :func:`ulysses`
  (:class:`UlyssesAttention`, a ``TorchFunctionMode``), and a user's attention function wrapped by :func:`ulysses`
  does the same;
* the loss of each rank's slice is weighted by its share of the counted tokens (:func:`token_weight`), so the
  gradients (which FSDP averages over the data and sequence ranks) and the returned loss are those of the mean over
  the whole sequence, also when slices hold different numbers of ignored tokens.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fabric_core.utilities import apply_to_collection

__all__ = ["SequenceShapeError", "UlyssesAttention", "shard_sequence", "token_weight", "ulysses"]


class SequenceShapeError(ValueError):
    """A sequence length or a head count that the ``sequence`` axis does not divide."""


#: Set while a :func:`ulysses`-wrapped attention runs: an SDPA call inside it is already on whole sequences.
_INSIDE = contextvars.ContextVar("fabric_fsdp_ulysses_inside", default=False)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into ``group``'s size along ``scatter``, send part ``j`` to rank ``j``, and join what arrives along
    ``gather`` in rank order. Its gradient is the same exchange the other way round."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather)


def all_to_all(x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
    """Autograd-aware all-to-all over ``group``: ``x`` split along ``scatter``, the parts joined along ``gather``."""
    return _AllToAll.apply(x, group, scatter, gather)


def _check_heads(name: str, tensor: Tensor, head_dim: int, size: int) -> None:
    heads = tensor.shape[head_dim]
    if heads % size:
        raise SequenceShapeError(
            f"Ulysses sequence parallelism gives each of the {size} ranks of the `sequence` axis an equal share of the"
            f" attention heads, but `{name}` has {heads} head(s) (dimension {head_dim} of shape {tuple(tensor.shape)})."
            f" Use a `sequence_parallel_size` that divides {heads}, or a model with a head count divisible by {size}."
        )


def ulysses(
    attention: Callable[..., Tensor], group: Any, *, head_dim: int = 1, seq_dim: int = 2
) -> Callable[..., Tensor]:
    """``attention(q, k, v, *args, **kwargs)`` on sequence-sharded inputs, made to attend over the whole sequence.

    ``q``, ``k``, ``v`` hold this rank's slice of the sequence with all heads (``(batch, heads, seq, dim)``, the layout
    of ``F.scaled_dot_product_attention``; other layouts by ``head_dim``/``seq_dim``); they are exchanged so that
    ``attention`` gets the whole sequence for ``1/sp`` of the heads, and its output is exchanged back. Keys and
    values may have fewer heads than queries (grouped-query attention) if the axis divides both. An ``attn_mask``
    keyword must cover the whole sequence (it is cut to this rank's heads when it has one per head).
    """
    size = dist.get_world_size(group)

    def wrapped(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if size == 1:
            return attention(q, k, v, *args, **kwargs)
        for name, t in (("query", q), ("key", k), ("value", v)):
            _check_heads(name, t, head_dim, size)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, Tensor):
            kwargs["attn_mask"] = _mask_for_heads(mask, q, group, head_dim, seq_dim, size)
        q, k, v = (all_to_all(t, group, head_dim, seq_dim) for t in (q, k, v))
        token = _INSIDE.set(True)
        try:
            out = attention(q, k, v, *args, **kwargs)
        finally:
            _INSIDE.reset(token)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"The attention function wrapped by `ulysses` must return the attention output as one tensor, got"
                f" {type(out).__name__}."
            )
        return all_to_all(out, group, seq_dim, head_dim)

    wrapped.__wrapped__ = attention  # type: ignore[attr-defined]
    return wrapped


def _mask_for_heads(mask: Tensor, q: Tensor, group: Any, head_dim: int, seq_dim: int, size: int) -> Tensor:
    full = q.shape[seq_dim] * size
    if mask.dim() < 2 or mask.shape[-1] != full or mask.shape[-2] not in (1, full):
        raise SequenceShapeError(
            f"With sequence parallelism, attention runs over the whole sequence ({full} positions), but `attn_mask`"
            f" has shape {tuple(mask.shape)}. Pass a mask over the whole sequence (..., {full}, {full}), or use"
            " `is_causal=True`."
        )
    if mask.dim() == 4 and mask.shape[1] == q.shape[head_dim] and mask.shape[1] > 1:
        rank = dist.get_rank(group)
        return mask.chunk(size, dim=1)[rank]
    return mask


class UlyssesAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on sequence-sharded ``q``/``k``/``v`` goes through
    :func:`ulysses` (except inside an attention function that :func:`ulysses` already wraps)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.sdpa = ulysses(F.scaled_dot_product_attention, group)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not _INSIDE.get():
            return self.sdpa(*args, **kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------- inputs, loss
def sequence_length(obj: Any, dim: int) -> int | None:
    """The sequence length of the first tensor in ``obj`` that has dimension ``dim``."""
    found: list[int] = []
    apply_to_collection(obj, Tensor, lambda t: found.append(t.shape[dim]) if t.dim() > dim else None)
    return found[0] if found else None


def shard_sequence(obj: Any, length: int, dim: int, rank: int, size: int) -> Any:
    """This rank's slice (``rank`` of ``size`` equal ones) along ``dim`` of every tensor in ``obj`` whose size there is
    ``length``; other values as they are."""
    if length % size:
        raise SequenceShapeError(
            f"The sequence has {length} positions (dimension {dim} of the inputs), which the {size} ranks of the"
            f" `sequence` axis cannot share equally. Pad or cut sequences to a multiple of {size}, or change"
            " `sequence_parallel_size`."
        )
    part = length // size

    def cut(t: Tensor) -> Tensor:
        if t.dim() > dim and t.shape[dim] == length:
            return t.narrow(dim, rank * part, part)
        return t

    return apply_to_collection(obj, Tensor, cut)


def positions(batch: int, length: int, rank: int, size: int, device: torch.device) -> Tensor:
    """``position_ids`` of this rank's slice: ``(batch, length / size)`` with ``rank * length / size`` first."""
    part = length // size
    return torch.arange(rank * part, (rank + 1) * part, device=device).unsqueeze(0).expand(batch, part)


def counted_tokens(target: Any, ignore_index: int | None) -> Tensor:
    """How many target elements the loss averages over: integer targets equal to ``ignore_index`` do not count."""
    tensors: list[Tensor] = []
    apply_to_collection(target, Tensor, tensors.append)
    if not tensors:
        return torch.ones(())
    t = tensors[0]
    if ignore_index is not None and not t.is_floating_point() and not t.is_complex():
        return (t != ignore_index).sum().to(torch.float64)
    return torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)


def token_weight(target: Any, ignore_index: int | None, group: Any) -> float:
    """This rank's share of the counted tokens times the group's size: weighing each rank's mean loss by it makes the
    mean over the group the mean over all its tokens (1.0 when every slice counts the same number)."""
    count = counted_tokens(target, ignore_index)
    total = count.clone()
    dist.all_reduce(total, group=group)
    size = dist.get_world_size(group)
    return float(count) * size / max(float(total), 1.0)


def takes_keyword(module: Module, name: str) -> bool:
    """Whether ``module.forward`` accepts the keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
