"""Walk nested batches and metrics: move them to a device, turn python numbers into tensors and back.

Training loops pass around arbitrary containers (dicts of lists of tensors, namedtuples, dataclasses), so every
transformation here goes through :func:`apply_to_collection`, which rebuilds the containers and never mutates the
caller's data.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from abc import ABC
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "apply_to_collection",
    "batch_mover",
    "iterate_moved",
    "convert_tensors_to_scalars",
    "convert_to_tensors",
    "move_data_to_device",
]

_BLOCKING_DEVICE_TYPES = ("cpu", "mps")


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _is_dataclass_instance(obj: object) -> bool:
    # ``is_dataclass`` is also true for the class itself, which must stay a leaf.
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def apply_to_collection(
    data: Any, dtype: type | tuple[type, ...], function: Callable, *args: Any, **kwargs: Any
) -> Any:
    """Return a copy of ``data`` with ``function(leaf, *args, **kwargs)`` applied to every leaf of type ``dtype``.

    Dicts (including ``OrderedDict`` and ``defaultdict``), lists, tuples, namedtuples, sets and dataclass instances
    are rebuilt with their original type so user code downstream sees the same structure; any other object is
    returned as is. Dataclasses are shallow-copied and their fields re-assigned, which avoids running ``__init__`` /
    ``__post_init__`` again and also covers ``init=False`` and frozen fields.
    """
    if isinstance(data, dtype):
        return function(data, *args, **kwargs)

    def recurse(value: Any) -> Any:
        return apply_to_collection(value, dtype, function, *args, **kwargs)

    if isinstance(data, Mapping):
        items = [(key, recurse(value)) for key, value in data.items()]
        if isinstance(data, defaultdict):
            return type(data)(data.default_factory, items)
        try:
            return type(data)(items)
        except TypeError:
            # A mapping type that cannot be built from pairs (e.g. ``MappingProxyType``): a plain dict keeps the data.
            return dict(items)

    if _is_namedtuple(data):
        return type(data)(*(recurse(value) for value in data))

    if isinstance(data, (list, tuple, set, frozenset)):
        return type(data)(recurse(value) for value in data)

    if _is_dataclass_instance(data):
        result = copy.copy(data)
        for field in dataclasses.fields(data):
            if not hasattr(data, field.name):
                # ``init=False`` field that was never assigned: nothing to transform.
                continue
            # ``object.__setattr__`` also works for frozen dataclasses; the copy is ours to fill in.
            object.__setattr__(result, field.name, recurse(getattr(data, field.name)))
        return result

    return data


class _TransferableDataType(ABC):  # noqa: B024 - only a structural isinstance check
    """Duck type for anything with a callable ``.to``: tensors, modules, user batch classes."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is _TransferableDataType:
            return callable(getattr(subclass, "to", None))
        return NotImplemented


def _as_device(device: torch.device | str | int) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Move every object with a ``.to`` method inside ``batch`` to ``device``.

    Tensor copies to an accelerator are ``non_blocking`` so they can overlap with compute; copies to CPU/MPS stay
    blocking because a non-blocking copy there may be read before it has landed. A custom ``.to`` that works in
    place and returns ``None`` keeps the original object instead of putting ``None`` into the batch.
    """
    target = _as_device(device)

    def transfer(data: Any) -> Any:
        kwargs: dict[str, Any] = {}
        if isinstance(data, Tensor) and target.type not in _BLOCKING_DEVICE_TYPES:
            kwargs["non_blocking"] = True
        moved = data.to(target, **kwargs)
        return data if moved is None else moved

    # `Tensor` first: the common leaf is settled by a plain isinstance, before the duck-typed ABC check.
    return apply_to_collection(batch, dtype=(Tensor, _TransferableDataType), function=transfer)


_CPU = torch.device("cpu")


def batch_mover(device: torch.device | str | int) -> Callable[[Any], Any]:
    """A ``move_data_to_device(batch, device)`` for every batch of a loader, quicker on the common batches.

    A tensor, or a plain ``list``/``tuple``/``dict`` of tensors, is moved without the generic walk; on the CPU,
    tensors that are already there are not touched at all (``.to`` would return them as they are). Anything
    else (nested containers, namedtuples, tensor subclasses, custom batch classes) goes through
    :func:`move_data_to_device`, so the result is always the same as that function's.
    """
    target = _as_device(device)
    if target == _CPU:

        def move_to_cpu(batch: Any) -> Any:
            cls = type(batch)
            if cls is Tensor:
                if batch.is_cpu:
                    return batch
            elif cls is list or cls is tuple:
                for item in batch:
                    if type(item) is not Tensor or not item.is_cpu:
                        break
                else:
                    return cls(batch)
            elif cls is dict:
                for item in batch.values():
                    if type(item) is not Tensor or not item.is_cpu:
                        break
                else:
                    return dict(batch)
            return move_data_to_device(batch, target)

        return move_to_cpu

    kwargs = {} if target.type in _BLOCKING_DEVICE_TYPES else {"non_blocking": True}

    def move_batch(batch: Any) -> Any:
        cls = type(batch)
        if cls is Tensor:
            return batch.to(target, **kwargs)
        if cls is list or cls is tuple:
            for item in batch:
                if type(item) is not Tensor:
                    break
            else:
                return cls([t.to(target, **kwargs) for t in batch])
        elif cls is dict:
            for item in batch.values():
                if type(item) is not Tensor:
                    break
            else:
                return {key: t.to(target, **kwargs) for key, t in batch.items()}
        return move_data_to_device(batch, target)

    return move_batch


def convert_to_tensors(data: Any, device: torch.device | str | int) -> Any:
    """Turn python ``bool``/``int``/``float`` and numpy arrays in ``data`` into tensors on ``device``.

    Collectives only understand tensors; fixed dtypes (uint8, int32, float32) make every rank produce the same
    dtype regardless of the python value. Other leaves are left unchanged.
    """
    # numpy is optional: if it was never imported, no ndarray can be inside ``data``.
    np = sys.modules.get("numpy")
    leaf_types: tuple[type, ...] = (bool, int, float)
    if np is not None:
        leaf_types += (np.ndarray,)

    def to_tensor(value: Any) -> Tensor:
        # ``bool`` is checked before ``int`` because it is a subclass of it.
        if isinstance(value, bool):
            return torch.tensor(value, dtype=torch.uint8)
        if isinstance(value, int):
            return torch.tensor(value, dtype=torch.int32)
        if isinstance(value, float):
            return torch.tensor(value, dtype=torch.float32)
        # ``torch.tensor`` copies, so the result never aliases (or chokes on read-only / negatively strided) arrays.
        return torch.tensor(value)

    return move_data_to_device(apply_to_collection(data, leaf_types, to_tensor), device)


def convert_tensors_to_scalars(data: Any) -> Any:
    """Replace each single-element tensor in ``data`` by its python scalar, e.g. for logging.

    A tensor with more than one element cannot become a scalar, so that raises ``ValueError`` rather than silently
    picking an element. The input collection is not modified.
    """

    def to_item(value: Tensor) -> int | float | bool:
        if value.numel() != 1:
            raise ValueError(
                f"The metric `{value}` does not contain a single element, thus it cannot be converted to a scalar."
            )
        return value.item()

    return apply_to_collection(data, Tensor, to_item)


def iterate_moved(
    start: Callable[[], Iterator[Any]],
    device: torch.device | str | int,
    exhausted: Callable[[], None] | None = None,
) -> Generator[Any, None, None]:
    """Yield the batches of ``start()`` moved to ``device``, each exactly as :func:`move_data_to_device` would.

    ``start`` runs at the first ``next()``, so a loader's epoch begins when iteration does; ``exhausted`` runs
    once ``start()``'s iterator has ended (not when the generator is closed early). For the CPU, the test for the
    most common batch (a list or tuple of CPU tensors, as ``default_collate`` builds them) is the one in
    :func:`batch_mover`, inlined here: such a batch costs no call beyond the loop itself.
    """
    iterator = start()
    move = batch_mover(device)
    if _as_device(device) != _CPU:
        yield from map(move, iterator)
        if exhausted is not None:
            exhausted()
        return
    for batch in iterator:
        cls = type(batch)
        if cls is list or cls is tuple:
            for item in batch:
                if type(item) is not Tensor or not item.is_cpu:
                    break
            else:
                yield cls(batch)
                continue
        yield move(batch)
    if exhausted is not None:
        exhausted()
