"""Make a user's DataLoader distributed: pick a distributed sampler and rebuild the loader around it.

A DataLoader's sampler cannot be swapped after construction, so the loader has to be created again with the same
arguments. Those arguments are read back from instance attributes, or, for subclasses whose ``__init__`` takes
arguments it does not store, from the constructor arguments recorded by :func:`capture_init_arguments`.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fabric_core.utilities.exceptions import on_failure
from fabric_core.utilities.sampler_order import SamplerIndices, wrapped_sampler_seed

__all__ = [
    "DataLoaderRebuildError",
    "DistributedSamplerWrapper",
    "capture_init_arguments",
    "distributed_sampler_for",
    "global_order_sampler_for",
    "needs_distributed_sampler",
    "reinstantiate_dataloader",
    "wrapped_sampler_seed",
]

if TYPE_CHECKING:
    from fabric_core.utilities.global_order import DataCursor, GlobalOrderSampler

_HINT_NO_SAMPLER = (
    "Alternatively, pass `use_distributed_sampler=False` to `setup_dataloaders` and take care of splitting the data"
    " across processes yourself."
)


class DataLoaderRebuildError(TypeError):
    """Raised when a DataLoader (or batch sampler) cannot be re-created with a distributed sampler."""


# --------------------------------------------------------------------------------------------------------------------
# Distributed sampler over another sampler
# --------------------------------------------------------------------------------------------------------------------


def _check_finite_length(sampler: object) -> None:
    try:
        len(sampler)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError, OverflowError) as err:
        raise TypeError(
            "You seem to have configured a sampler in your DataLoader which does not provide `__len__` method (or"
            f" its length is infinite): `{type(sampler).__name__}`. A distributed sampler has to know the number of"
            " indices to split them evenly between processes. " + _HINT_NO_SAMPLER
        ) from err


class DistributedSamplerWrapper(DistributedSampler):
    """A ``DistributedSampler`` that shards the indices yielded by another sampler instead of a dataset.

    Each process gets a disjoint, equally long part of the wrapped sampler's output, so custom sampling strategies
    (weighted, grouped, ...) keep working under data parallelism. The wrapped sampler is iterated again on every
    ``__iter__`` so per-epoch randomness is preserved.

    Sharding is only disjoint if every rank materialises the same order. So each ``__iter__`` draws the wrapped
    order from RNGs seeded with :func:`wrapped_sampler_seed` ``(seed, epoch)``: the sampler's own ``generator``
    (if it has one that is ``None`` or a ``torch.Generator``) and the global torch/``random``/NumPy RNGs, all
    restored afterwards. The order is then a function of ``(seed, epoch)`` and the sampler's own attributes, the
    same on every rank. A sampler with a private RNG of another kind, or whose attributes differ between ranks, is
    outside this guarantee.
    """

    def __init__(
        self,
        sampler: Sampler,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        _check_finite_length(sampler)
        super().__init__(
            SamplerIndices(sampler),  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    @property
    def sampler(self) -> Sampler:
        """The wrapped sampler."""
        return self.dataset.sampler  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        indices: SamplerIndices = self.dataset  # type: ignore[assignment]
        indices.refresh(wrapped_sampler_seed(self.seed, self.epoch))
        return (indices[position] for position in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        """Set the shuffling epoch here and in the wrapped sampler, so both reshuffle consistently across ranks."""
        super().set_epoch(epoch)
        forward = getattr(self.sampler, "set_epoch", None)
        if callable(forward):
            forward(epoch)


# --------------------------------------------------------------------------------------------------------------------
# Choosing a sampler
# --------------------------------------------------------------------------------------------------------------------


def _effective_sampler(dataloader: DataLoader) -> Sampler:
    """The sampler that really decides the order: the one inside a user-given batch sampler, if any.

    With ``DataLoader(batch_sampler=...)`` the loader's own ``.sampler`` is a placeholder ``SequentialSampler``.
    """
    inner = getattr(dataloader.batch_sampler, "sampler", None)
    return inner if inner is not None else dataloader.sampler


def needs_distributed_sampler(dataloader: DataLoader) -> bool:
    """Whether the data side of ``dataloader`` calls for a distributed sampler.

    Iterable datasets have no sampler to replace, and an existing ``DistributedSampler`` means the user already
    shards. Whether the strategy is distributed and ``use_distributed_sampler`` are for the caller to check.
    """
    if isinstance(dataloader.dataset, IterableDataset):
        return False
    return not isinstance(_effective_sampler(dataloader), DistributedSampler)


#: Libraries whose iterable datasets split their stream across ranks by themselves (litdata's StreamingDataset,
#: MosaicML's ``streaming``): the top-level package of the dataset class's module.
SELF_SHARDING_PACKAGES = frozenset({"litdata", "streaming"})


def shards_itself(dataset: object, world_size: int) -> bool:
    """Whether an ``IterableDataset`` splits its stream across the ``world_size`` ranks by itself.

    The rule (docs/decisions.md, "Data"): its class comes from a library that does (:data:`SELF_SHARDING_PACKAGES`),
    or it carries the job's layout, an attribute ``world_size`` or ``num_replicas`` equal to ``world_size`` on the
    dataset or on its ``distributed_env`` (litdata) or ``_distributed`` (🤗 Datasets after
    ``split_dataset_by_node``). A dataset that reads the rank only inside ``__iter__`` cannot be told apart from one
    that does not shard: Fabric then warns, and the warning says how to silence it.
    """
    if type(dataset).__module__.split(".", 1)[0] in SELF_SHARDING_PACKAGES:
        return True
    holders = [dataset, getattr(dataset, "distributed_env", None), getattr(dataset, "_distributed", None)]
    for holder in holders:
        for name in ("world_size", "num_replicas"):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value == world_size:
                return True
    return False


def _is_plain_random_sampler(sampler: Sampler) -> bool:
    # A RandomSampler drawing with replacement or a custom number of samples cannot be expressed as a
    # DistributedSampler over the dataset; such samplers are wrapped instead.
    return isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None


def distributed_sampler_for(
    dataloader: DataLoader, num_replicas: int, rank: int, seed: int = 0
) -> DistributedSampler | None:
    """Return the distributed replacement for the sampler of ``dataloader``, or ``None`` to leave it alone.

    Shuffling is inherited: only a ``RandomSampler`` leads to a shuffling distributed sampler. Default samplers are
    replaced by a ``DistributedSampler`` over the dataset; any other sampler is sharded through
    :class:`DistributedSamplerWrapper` so its sampling logic is kept.
    """
    if not needs_distributed_sampler(dataloader):
        return None
    old = _effective_sampler(dataloader)
    shuffle = isinstance(old, RandomSampler)
    if _is_plain_random_sampler(old) or isinstance(old, SequentialSampler):
        return DistributedSampler(
            dataloader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
    return DistributedSamplerWrapper(old, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)


def _loader_batch_size(dataloader: DataLoader) -> tuple[int | None, bool]:
    """The per-rank batch size and ``drop_last`` the loader batches with, when it batches by size itself."""
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and dataloader.batch_size is None:
        return batch_sampler.batch_size, batch_sampler.drop_last
    return dataloader.batch_size, dataloader.drop_last


def global_order_sampler_for(
    dataloader: DataLoader,
    num_replicas: int,
    rank: int,
    seed: int = 0,
    global_batch_size: int | None = None,
    cursor: DataCursor | None = None,
) -> GlobalOrderSampler | None:
    """The :class:`~fabric_core.utilities.global_order.GlobalOrderSampler` for ``dataloader``, or ``None`` where the
    order cannot be global (see docs/decisions.md, "Elastic training").

    The same choice as :func:`distributed_sampler_for` (a ``RandomSampler`` or ``SequentialSampler`` orders the
    dataset, shuffling as the sampler did; any other finite sampler's output is wrapped), for loaders that batch by
    size themselves: a batch sampler of the user's own groups indices its own way, so a step's share would not be one
    batch; such loaders (and iterable datasets, and loaders that already have a ``DistributedSampler``) get ``None``.
    ``cursor`` (the strategy's :meth:`~fabric_core.strategies.Strategy.data_cursor`) decides where each global batch
    starts and its shares.
    """
    from fabric_core.utilities.global_order import GlobalOrderSampler, check_global_batch_size

    if not needs_distributed_sampler(dataloader) or not _loader_builds_its_batch_sampler(dataloader):
        if global_batch_size is not None:
            raise ValueError(
                "`global_batch_size` needs a loader that batches by `batch_size` itself, over a map-style dataset,"
                " without a `DistributedSampler` of its own: Fabric then cuts every global batch into the ranks'"
                " shares. This loader has an iterable dataset, a batch sampler of its own or a `DistributedSampler`."
            )
        return None
    batch_size, drop_last = _loader_batch_size(dataloader)
    if batch_size is None and global_batch_size is not None:
        raise ValueError(
            "`global_batch_size` needs a loader that makes batches (`batch_size` set), not one that yields single"
            " samples (`batch_size=None`)."
        )
    if global_batch_size is not None:
        check_global_batch_size(global_batch_size, num_replicas)
    old = _effective_sampler(dataloader)
    _check_finite_length(old)
    plain = _is_plain_random_sampler(old) or isinstance(old, SequentialSampler)
    return GlobalOrderSampler(
        dataloader.dataset if plain else old,
        num_replicas,
        rank,
        shuffle=isinstance(old, RandomSampler) and plain,
        seed=seed,
        batch_size=batch_size or 1,
        global_batch_size=global_batch_size,
        drop_last=bool(drop_last),
        wrapped=not plain,
        cursor=cursor,
    )


# --------------------------------------------------------------------------------------------------------------------
# Capturing constructor arguments
# --------------------------------------------------------------------------------------------------------------------

_ARGS_ATTR = "__fabric_init_args"
_OWNER_ATTR = "__fabric_init_owner"
_CAPTURE_BASES: tuple[type, ...] = (DataLoader, BatchSampler)

_capture_lock = threading.RLock()
_capture_depth = 0
_patched_inits: list[tuple[type, Any]] = []
_patched_hooks: list[tuple[type, Any]] = []


def _init_owner(cls: type) -> type:
    """The class whose ``__init__`` runs for instances of ``cls`` (the first in the MRO that defines one)."""
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            return klass
    return object


def _all_subclasses(cls: type) -> list[type]:
    seen: dict[type, None] = {cls: None}
    stack = [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                stack.append(sub)
    return list(seen)


def _patch_init(cls: type) -> None:
    original = cls.__dict__["__init__"]

    @functools.wraps(original)
    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        # The outermost ``__init__`` runs first and is the one whose arguments re-create the object;
        # the ``super().__init__`` calls it makes must not overwrite them.
        state = getattr(self, "__dict__", None)
        if state is not None and _ARGS_ATTR not in state:
            state[_ARGS_ATTR] = (args, dict(kwargs))
            state[_OWNER_ATTR] = cls
        original(self, *args, **kwargs)

    cls.__init__ = recording_init  # type: ignore[misc]
    _patched_inits.append((cls, original))


def _install_subclass_hook(base: type) -> None:
    """Patch classes derived from ``base`` while capturing is active, e.g. a DataLoader defined inside ``launch``."""
    original = base.__dict__.get("__init_subclass__")

    def hook(cls: type, **kwargs: Any) -> None:
        if original is not None:
            original.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        if "__init__" in cls.__dict__:
            _patch_init(cls)

    base.__init_subclass__ = classmethod(hook)  # type: ignore[assignment]
    _patched_hooks.append((base, original))


def _uninstall() -> None:
    while _patched_hooks:
        base, original = _patched_hooks.pop()
        if original is None:
            del base.__init_subclass__
        else:
            base.__init_subclass__ = original  # type: ignore[assignment]
    while _patched_inits:
        cls, original = _patched_inits.pop()
        cls.__init__ = original  # type: ignore[misc]


@contextmanager
def capture_init_arguments() -> Iterator[None]:
    """Record the constructor arguments of every DataLoader and BatchSampler (subclass) created inside the block.

    Subclasses often take ``__init__`` arguments they do not keep as attributes, which makes them impossible to
    re-create with a distributed sampler afterwards. While the block is active the ``__init__`` of these classes
    (including subclasses defined inside the block) stores ``(args, kwargs)`` on the instance as
    ``__fabric_init_args``. Nested use is allowed; the patches are removed when the outermost block exits.
    """
    global _capture_depth
    with _capture_lock:
        if _capture_depth == 0:
            with on_failure(_uninstall):
                for base in _CAPTURE_BASES:
                    for cls in _all_subclasses(base):
                        if "__init__" in cls.__dict__:
                            _patch_init(cls)
                    _install_subclass_hook(base)
        _capture_depth += 1
    try:
        yield
    finally:
        with _capture_lock:
            _capture_depth -= 1
            if _capture_depth == 0:
                _uninstall()


# --------------------------------------------------------------------------------------------------------------------
# Re-creating objects
# --------------------------------------------------------------------------------------------------------------------


def _init_signature(cls: type) -> inspect.Signature:
    init = inspect.unwrap(_init_owner(cls).__dict__.get("__init__", object.__init__))
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    if params and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        params = params[1:]  # drop ``self``
    return signature.replace(parameters=params)


def _captured_arguments(obj: object, signature: inspect.Signature) -> inspect.BoundArguments | None:
    state = getattr(obj, "__dict__", {})
    if _ARGS_ATTR not in state or state.get(_OWNER_ATTR) is not _init_owner(type(obj)):
        # Not captured, or captured by a parent ``__init__`` whose arguments do not match this class's signature.
        return None
    args, kwargs = state[_ARGS_ATTR]
    try:
        return signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None


def _same_value(a: Any, b: Any) -> bool:
    return a is b or (type(a) in (bool, int, float, str, type(None)) and type(a) is type(b) and a == b)


_UNREADABLE = object()


def _attribute(obj: object, name: str) -> Any:
    """``obj.name``, or ``_UNREADABLE`` where there is none or reading it raises."""
    try:
        return getattr(obj, name)
    except Exception:  # a user's property may raise anything: the argument is taken as not recoverable
        return _UNREADABLE


def _arguments_from_attributes(
    obj: object, signature: inspect.Signature, base: type
) -> tuple[inspect.BoundArguments, list[str]]:
    """Fill the constructor arguments from same-named attributes; return them and the required ones not found."""
    bound = signature.bind_partial()
    var_kw = next(
        (p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    missing: list[str] = []
    for param in signature.parameters.values():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        value = _attribute(obj, param.name)
        if value is _UNREADABLE:
            if param.default is inspect.Parameter.empty:
                missing.append(param.name)
            continue
        if param.default is inspect.Parameter.empty or not _same_value(value, param.default):
            bound.arguments[param.name] = value
    if var_kw is not None and type(obj) is not base:
        # ``**kwargs`` are most likely forwarded to the base class, so its arguments are recovered as well.
        extra: dict[str, Any] = {}
        for param in _init_signature(base).parameters.values():
            if param.name in signature.parameters or param.kind in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            ):
                continue
            value = _attribute(obj, param.name)
            if value is _UNREADABLE:
                continue
            if param.default is inspect.Parameter.empty or not _same_value(value, param.default):
                extra[param.name] = value
        if extra:
            bound.arguments[var_kw] = extra
    return bound, missing


_MULTIPLE_VALUES = re.compile(r"got multiple values for (?:keyword )?argument '(\w+)'")


def _construct(cls: type, bound: inspect.BoundArguments) -> Any:
    """``cls(*bound.args, **bound.kwargs)``, explaining the one mistake re-creation commonly uncovers."""
    try:
        return cls(*bound.args, **bound.kwargs)
    except TypeError as err:
        match = _MULTIPLE_VALUES.search(str(err))
        if match is None:
            raise
        name = match.group(1)
        raise DataLoaderRebuildError(
            f"The `{cls.__name__}` implementation has an error where more than one `__init__` argument can be"
            f" passed to its parent's `{name}=...` `__init__` argument. This is likely caused by"
            f" `{cls.__name__}.__init__` setting `{name}` itself while also forwarding `**kwargs` that carry"
            f" `{name}` too: to inject a (distributed) sampler, Fabric re-creates the object with the arguments"
            f" it was built with, `{name}` among them. Filter `kwargs` so they don't contain the `{name}` key (e.g."
            f" `kwargs.pop({name!r}, None)` before calling `super().__init__`). " + _HINT_NO_SAMPLER
        ) from err


def _rebuild(obj: Any, base: type, overrides: dict[str, Any], required: tuple[str, ...]) -> Any:
    """Create a new ``type(obj)`` with the same constructor arguments, except for ``overrides``.

    Keys in ``required`` must be accepted by the constructor; other overrides are only passed where accepted.
    """
    cls = type(obj)
    signature = _init_signature(cls)
    bound = _captured_arguments(obj, signature)
    if bound is None:
        bound, missing = _arguments_from_attributes(obj, signature, base)
        missing = [name for name in missing if name not in overrides]
        if missing:
            raise DataLoaderRebuildError(
                f"Trying to inject custom `Sampler` into the `{cls.__name__}` instance. This would fail as some of"
                " the `__init__` arguments are not available as instance attributes. The missing attributes are"
                f" {missing}. Store them as attributes with the same names, or create the `{cls.__name__}` inside"
                " `fabric.launch(fn)` / `fabric.run()`, where constructor arguments are captured"
                " (`capture_init_arguments()`). " + _HINT_NO_SAMPLER
            )

    params = signature.parameters
    var_kw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    not_accepted = []
    for name, value in overrides.items():
        if name in params and params[name].kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            bound.arguments[name] = value
        elif var_kw is not None:
            bound.arguments[var_kw] = {**bound.arguments.get(var_kw, {}), name: value}
        elif name in required:
            not_accepted.append(name)
    if not_accepted and base is BatchSampler:
        raise DataLoaderRebuildError(
            "Trying to inject a modified sampler into the batch sampler; however, it seems the class"
            f" `{cls.__name__}` does not have an argument called `sampler` (neither by name nor through"
            " `**kwargs`). Add a `sampler` argument to its `__init__` and pass it on to `BatchSampler.__init__`. "
            + _HINT_NO_SAMPLER
        )
    if not_accepted:
        raise DataLoaderRebuildError(
            f"Trying to inject parameters into the `{cls.__name__}` instance. This would fail as it doesn't expose"
            f" all its attributes in the `__init__` signature. The missing arguments are {not_accepted} (accepted"
            " neither by name nor through `**kwargs`). Add them to the signature and forward them to the base"
            " class. " + _HINT_NO_SAMPLER
        )
    return _construct(cls, bound)


def _rebuild_batch_sampler(batch_sampler: BatchSampler, sampler: Sampler) -> BatchSampler:
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    return _rebuild(batch_sampler, BatchSampler, {"sampler": sampler}, required=("sampler",))


_BATCH_SAMPLER_API = (
    " To mitigate this, either follow the API of `BatchSampler` (subclass `torch.utils.data.BatchSampler`, or"
    " accept `Cls(sampler, batch_size=..., drop_last=...)` and keep `batch_size` and `drop_last` as attributes),"
    " or pass `use_distributed_sampler=False` to `setup_dataloaders` and shard the indices inside your batch"
    " sampler yourself."
)


def _rebuild_duck_batch_sampler(batch_sampler: Any, sampler: Sampler) -> Any:
    """Re-create a batch sampler that has ``BatchSampler``'s interface without subclassing it."""
    cls = type(batch_sampler)
    name = cls.__name__
    if not (hasattr(batch_sampler, "batch_size") and hasattr(batch_sampler, "drop_last")):
        raise DataLoaderRebuildError(
            f"Fabric can't inject a (distributed) sampler into your batch sampler `{name}`, because it doesn't"
            " subclass PyTorch's `BatchSampler` and has no `batch_size` and `drop_last` attributes to re-create it"
            " with." + _BATCH_SAMPLER_API.replace("Cls", name)
        )
    try:
        return cls(sampler, batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last)
    except TypeError as err:
        raise DataLoaderRebuildError(
            f"Fabric can't inject a (distributed) sampler into your batch sampler `{name}`, because it doesn't"
            f" subclass PyTorch's `BatchSampler` and re-creating it as `{name}(sampler, batch_size=...,"
            f" drop_last=...)` failed: {err}." + _BATCH_SAMPLER_API.replace("Cls", name)
        ) from err


def _loader_builds_its_batch_sampler(dataloader: DataLoader) -> bool:
    """Whether re-creating ``dataloader`` with ``sampler=``/``batch_size=`` gives it its batch sampler again.

    True without a batch sampler, for a plain ``BatchSampler``, and for one the loader made itself: a DataLoader
    keeps ``batch_size`` only when it built the batch sampler from it (torchdata's ``StatefulDataLoader`` builds a
    ``BatchSampler`` subclass of its own), and sets it to ``None`` for one passed as ``batch_sampler=``.
    """
    batch_sampler = dataloader.batch_sampler
    return batch_sampler is None or type(batch_sampler) is BatchSampler or dataloader.batch_size is not None


def reinstantiate_dataloader(dataloader: DataLoader, sampler: Sampler, batch_size: int | None = None) -> DataLoader:
    """Return a new loader of the same class and arguments as ``dataloader`` that draws indices from ``sampler``.

    A batch sampler the loader builds itself (the default one, also a library's own subclass such as torchdata's)
    and a plain ``BatchSampler`` passed explicitly are dropped: the loader builds one again from
    ``batch_size``/``drop_last`` around ``sampler``. A user's ``BatchSampler`` subclass is re-created around
    ``sampler`` so its batching logic is kept; so is a batch sampler that only has ``BatchSampler``'s interface
    (``batch_size``, ``drop_last``, iterable), as ``type(bs)(sampler, batch_size=..., drop_last=...)``.
    ``batch_size`` replaces the loader's own (a loader that builds its batch sampler; a rank's share of a fixed
    global batch).
    """
    batch_sampler = dataloader.batch_sampler
    overrides: dict[str, Any]
    if _loader_builds_its_batch_sampler(dataloader):
        overrides = {"sampler": sampler, "shuffle": False, "batch_sampler": None}
        if batch_sampler is not None and dataloader.batch_size is None:
            # Take the batching from the batch sampler: with ``batch_sampler=BatchSampler(...)`` the loader's own
            # ``batch_size`` is None.
            overrides["batch_size"] = batch_sampler.batch_size
            overrides["drop_last"] = batch_sampler.drop_last
        else:
            overrides["batch_size"] = dataloader.batch_size
            overrides["drop_last"] = dataloader.drop_last
        if batch_size is not None:
            overrides["batch_size"] = batch_size
        required: tuple[str, ...] = ("sampler",)
    else:
        if isinstance(batch_sampler, BatchSampler):
            new_batch_sampler = _rebuild_batch_sampler(batch_sampler, sampler)
        else:
            new_batch_sampler = _rebuild_duck_batch_sampler(batch_sampler, sampler)
        overrides = {
            "sampler": None,
            "shuffle": False,
            "batch_sampler": new_batch_sampler,
            "batch_size": 1,
            "drop_last": False,
        }
        required = ("batch_sampler",)
    return _rebuild(dataloader, DataLoader, overrides, required=required)
