"""The state a user hands to ``fabric.save``/``fabric.load``, walked once for every checkpoint format.

A user state dict mixes four kinds of values: modules, optimizers, other *stateful* objects (anything with
``state_dict``/``load_state_dict``: schedulers, dataloaders, custom counters) and plain values (step, epoch).
Every strategy and format treats them the same way except for *how* a module or an optimizer becomes a state
dict and back (gathered, sharded, wrapped in an engine). So the walk lives here once, and strategies pass in
only those two conversions:

* :func:`state_to_save` turns a user state into what is written (applying ``filter`` and adding the precision's
  own state under :data:`PRECISION_STATE_KEY`; a :class:`SplitStateful` object, such as Fabric's dataloader,
  keeps another library's layout under its key and Fabric's additions under :data:`EXTRA_STATE_KEY`);
* :func:`restore_state` loads a checkpoint back into a user state in place, with strict missing-key errors,
  and returns what the checkpoint holds beyond it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from torch.nn import Module
from torch.optim import Optimizer

#: Where a precision plugin's state (e.g. a GradScaler) is stored inside a checkpoint.
PRECISION_STATE_KEY = "__fabric_precision__"
#: Fabric's own additions to entries stored in another library's layout, by the entry's key (a dataloader's epoch
#: counter beside the state of the loader it wraps, stored as the reference stores it).
EXTRA_STATE_KEY = "__fabric_extra__"

Filter = Mapping[str, Callable[[str, Any], bool]]


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state a checkpoint can hold: ``state_dict()`` out, ``load_state_dict(state)`` back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class SplitStateful(Protocol):
    """A stateful object whose checkpoint entry keeps another library's layout, with Fabric's additions apart.

    ``checkpoint_state()`` returns ``(entry, extra)``: ``entry`` is stored under the object's key as that library
    (or the reference Fabric) stores it, ``extra`` (a dict, or ``None``) under :data:`EXTRA_STATE_KEY`; so a program
    that knows only the library's layout reads the entry, and Fabric restores both through
    ``load_checkpoint_state(entry, extra)`` (``extra`` is ``None`` for a checkpoint written by such a program).
    """

    def checkpoint_state(self) -> tuple[Any, dict[str, Any] | None]: ...

    def load_checkpoint_state(self, entry: Any, extra: dict[str, Any] | None) -> None: ...


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is :class:`Stateful` (both methods present and callable)."""
    return isinstance(obj, Stateful) and callable(obj.state_dict) and callable(obj.load_state_dict)


def state_to_save(
    state: Mapping[str, Any],
    *,
    module_state: Callable[[Module], Any],
    optimizer_state: Callable[[Optimizer], Any],
    filter: Filter | None = None,
    precision_state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint of ``state`` holds: modules and optimizers through the given conversions, stateful
    objects through ``state_dict()``, plain values as they are.

    ``filter[key](name, value) -> bool`` keeps only the matching entries of that key's state dict (an entry whose
    state becomes empty is dropped). A non-empty ``precision_state`` is stored under :data:`PRECISION_STATE_KEY`.
    """
    converted: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            value = module_state(obj)
        elif isinstance(obj, Optimizer):
            value = optimizer_state(obj)
        elif isinstance(obj, SplitStateful):
            value, extra = obj.checkpoint_state()
            if extra is not None:
                extras[key] = extra
        elif is_stateful(obj):
            value = obj.state_dict()
        else:
            value = obj
        if filter is not None and key in filter and isinstance(value, dict):
            value = {k: v for k, v in value.items() if filter[key](k, v)}
            if not value:
                continue
        converted[key] = value
    if extras:
        converted[EXTRA_STATE_KEY] = {k: v for k, v in extras.items() if k in converted}
    if precision_state:
        converted[PRECISION_STATE_KEY] = dict(precision_state)
    return converted


def check_filter(filter: Any, state: Mapping[str, Any]) -> None:
    """``fabric.save(filter=...)``: a dict of callables keyed by keys of ``state`` (the reference's errors)."""
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise TypeError(f"Filter should be a dictionary, given {filter!r}")
    unknown = set(filter) - set(state)
    if unknown:
        raise ValueError(f"The filter keys {unknown} are not present in the state keys {set(state)}.")
    for key, fn in filter.items():
        if not callable(fn):
            raise TypeError(f"Expected `fabric.save(filter=...)` for key {key!r} to be a callable, given {fn!r}")


def check_missing(state: Iterable[Any], available: Iterable[Any], strict: bool) -> None:
    """With ``strict``, every key the user asks for must be in the checkpoint: raise ``KeyError`` naming the first."""
    if not strict:
        return
    available = set(available)
    missing = [k for k in state if k not in available]
    if missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint. To"
            f" disable strict loading, set `strict=False`. Keys in the checkpoint: {sorted(map(str, available))}."
        )


def restore_state(
    state: Module | Optimizer | dict[str, Any] | None,
    checkpoint: dict[str, Any],
    *,
    strict: bool,
    load_module: Callable[[Module, Any, bool], None],
    load_optimizer: Callable[[Optimizer, Any], None],
    load_precision: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Load ``checkpoint`` into ``state`` in place and return the entries ``state`` did not ask for.

    * ``state`` a module or an optimizer: the checkpoint *is* its state dict (``fabric.load_raw``).
    * ``state`` empty or ``None``: nothing is restored; the whole checkpoint is returned.
    * otherwise each key is restored by kind (``load_module(module, value, strict)``,
      ``load_optimizer(optimizer, value)``, ``obj.load_state_dict(value)`` for stateful objects, replacement for
      plain values); with ``strict`` a key missing from the checkpoint is a ``KeyError``. The precision's
      state, if saved, goes to ``load_precision``.
    """
    if isinstance(state, Module):
        load_module(state, checkpoint, strict)
        return {}
    if isinstance(state, Optimizer):
        load_optimizer(state, checkpoint)
        return {}
    if not state:
        return checkpoint
    precision_state = checkpoint.pop(PRECISION_STATE_KEY, None)
    extras = checkpoint.pop(EXTRA_STATE_KEY, None) or {}
    check_missing(state, checkpoint, strict)
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, Module):
            load_module(obj, value, strict)
        elif isinstance(obj, Optimizer):
            load_optimizer(obj, value)
        elif isinstance(obj, SplitStateful):
            obj.load_checkpoint_state(value, extras.get(key))
        elif is_stateful(obj):
            obj.load_state_dict(value)
        else:
            state[key] = value
    if precision_state is not None:
        load_precision(precision_state)
    return checkpoint
