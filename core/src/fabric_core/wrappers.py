"""What ``fabric.setup*`` returns: thin wrappers around the user's module, optimizers and dataloaders.

They stay out of the hot path. What the strategy and precision add to plain PyTorch is decided once, in a
:class:`FastPaths` plan, when a wrapper (or ``fabric.backward``) first meets a strategy's precision object and
again only when that object is replaced; every call then only reads the plan. Where nothing is added the call
goes straight through: ``forward`` calls the inner module, ``step`` the optimizer's ``step``, ``fabric.backward``
``tensor.backward()``, and batches already on the CPU are not walked. Otherwise the full path runs: the
precision's context and dtype casts, the ``loss.backward()`` guard (:data:`backward_guard`), the strategy's step.
Nothing here imports ``torch._dynamo``: compiled modules are detected by class name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from functools import partial, wraps
from operator import attrgetter
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules import module as _torch_module
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler

from fabric_core.precision.base import Precision
from fabric_core.runtime import goodput
from fabric_core.runtime import ledger as _ledger
from fabric_core.utilities.apply import apply_to_collection, iterate_moved

if TYPE_CHECKING:
    from fabric_core.strategies.base import Strategy
    from fabric_core.utilities.global_order import GlobalOrderSampler

_DEFAULT_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _is_compiled(obj: Any) -> bool:
    return type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")


# What `nn.Module.__call__` consults before it goes straight to `forward`: module-wide hooks (dicts that torch
# mutates in place) and the tracing state. `FabricModule.__call__` checks the same and, on the plain path, calls
# the inner module directly; if this torch version keeps them elsewhere, it always defers to `nn.Module`.
_GLOBAL_HOOKS = tuple(
    getattr(_torch_module, name, None)
    for name in (
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
    )
)
_G_BACKWARD_PRE, _G_BACKWARD, _G_FORWARD, _G_FORWARD_PRE = (h if h is not None else {} for h in _GLOBAL_HOOKS)
# Under `torch.jit.trace`, `nn.Module.__call__` differs from `forward` only where the traced module's map names the
# module (`_slow_forward` records its scope); with no map (no module being traced) it calls `forward` as usual. A
# module attribute read instead of torch's tracing-state call (a pybind11 call, ~5 % of what the wrapper adds).
_jit_trace = getattr(torch.jit, "_trace", None)
_unpatched_module_call = getattr(Module, "_wrapped_call_impl", None)
_CAN_CALL_DIRECTLY = (
    all(isinstance(hooks, dict) for hooks in _GLOBAL_HOOKS)
    and hasattr(_jit_trace, "_trace_module_map")
    and _unpatched_module_call is not None
    and Module.__call__ is _unpatched_module_call
)


def _uses_base(obj: Any, base: type, names: tuple[str, ...]) -> bool:
    """Whether ``obj`` runs ``base``'s own code for every method in ``names`` (no override, no instance patch)."""
    own = getattr(obj, "__dict__", {})
    cls = type(obj)
    return all(name not in own and getattr(cls, name, None) is getattr(base, name) for name in names)


def _reads_precision_plainly(strategy: Strategy) -> bool:
    """Whether ``strategy.precision`` is the base property, so the plain paths may read ``strategy.configured_precision``.

    The plain paths run on every step; a property call there is a Python frame each time. A strategy that
    overrides the property keeps the full paths.
    """
    from fabric_core.strategies.base import Strategy

    return type(strategy).precision is Strategy.precision and "configured_precision" in getattr(strategy, "__dict__", {})


def precision_converts(precision: Precision) -> bool:
    """Whether the precision changes anything around ``forward`` (a context, or input/output dtype casts)."""
    if precision.input_dtype is not None:
        return True
    return not _uses_base(precision, Precision, ("convert_input", "convert_output", "forward_context"))


def plain_backward(strategy: Strategy) -> bool:
    """Whether ``strategy.backward`` amounts to ``tensor.backward(...)`` (no loss scaling, no engine)."""
    from fabric_core.strategies.base import Strategy

    return (
        _reads_precision_plainly(strategy)
        and _uses_base(strategy, Strategy, ("backward",))
        and _uses_base(strategy.precision, Precision, ("pre_backward", "backward", "post_backward"))
    )


def plain_optimizer_step(strategy: Strategy) -> bool:
    """Whether ``strategy.optimizer_step(optimizer)`` amounts to ``optimizer.step()``."""
    from fabric_core.strategies.base import Strategy

    return (
        _reads_precision_plainly(strategy)
        and strategy.optimizer_step_target is None
        and _uses_base(strategy, Strategy, ("optimizer_step",))
        and _uses_base(strategy.precision, Precision, ("optimizer_step",))
    )


class FastPaths:
    """What the wrappers and ``fabric.backward`` may skip for one strategy with one precision object.

    Decided once by the constructor; the hot paths only read it. Its holder (a ``FabricModule``, a
    ``FabricOptimizer``, a ``Fabric``) keeps the plan and makes a new one when ``strategy.configured_precision`` is
    no longer :attr:`precision`, the object the plan was made for (a replaced precision): one identity comparison
    per call. Reading ``configured_precision`` is only valid for strategies with the base ``precision`` property;
    for any other strategy every flag is ``False`` and the full paths run.
    """

    __slots__ = ("backward", "forward", "guard_outputs", "precision", "step")

    def __init__(self, strategy: Strategy) -> None:
        plainly = _reads_precision_plainly(strategy)
        precision = strategy.precision  # materialises the default precision, so the key below is that object
        #: the precision object this plan was made for
        self.precision = strategy.configured_precision
        #: outputs get the ``loss.backward()`` guard (the strategy or precision needs ``fabric.backward``)
        self.guard_outputs = bool(strategy.requires_fabric_backward)
        #: ``forward`` may call the inner module directly (no casts, no context, no guard)
        self.forward = plainly and not self.guard_outputs and not precision_converts(precision)
        #: ``fabric.backward`` may call ``tensor.backward`` directly
        self.backward = plain_backward(strategy)
        #: ``optimizer.step()`` may call the optimizer's own ``step``
        self.step = plain_optimizer_step(strategy)

    def __repr__(self) -> str:
        flags = ", ".join(f"{name}={getattr(self, name)}" for name in ("forward", "backward", "step", "guard_outputs"))
        return f"FastPaths({flags})"


class BackwardGuard:
    """Tells the ``loss.backward()`` guard on model outputs whether the backward running now is Fabric's.

    Where the strategy or precision must run ``fabric.backward`` (loss scaling, an engine), ``FabricModule`` attaches
    a gradient hook to its outputs (:meth:`attach`) that raises unless the backward runs inside :meth:`scope`.
    :attr:`armed` says whether any output ever got the hook: until then a plain ``fabric.backward`` need not enter
    the scope. One process-wide instance, :data:`backward_guard`: a model of one ``Fabric`` may be trained through
    another's ``backward``.
    """

    __slots__ = ("armed", "inside")

    def __init__(self) -> None:
        self.armed = False
        self.inside = False

    def attach(self, tensor: Tensor) -> Tensor:
        if tensor.requires_grad and tensor.grad_fn is not None:
            self.armed = True
            tensor.register_hook(self._check)
        return tensor

    def _check(self, grad: Tensor) -> Tensor:
        if not self.inside:
            raise RuntimeError(
                "The current strategy and precision selection requires you to call `fabric.backward(loss)` instead of"
                " `loss.backward()`."
            )
        return grad

    def scope(self) -> AbstractContextManager:
        """The duration of a Fabric backward (nests)."""
        return _FabricBackwardScope(self)


class _FabricBackwardScope(AbstractContextManager):
    __slots__ = ("guard", "previous")

    def __init__(self, guard: BackwardGuard) -> None:
        self.guard = guard
        self.previous = False

    def __enter__(self) -> None:
        self.previous = self.guard.inside
        self.guard.inside = True

    def __exit__(self, *exc: Any) -> None:
        self.guard.inside = self.previous


#: The process-wide guard (see :class:`BackwardGuard`).
backward_guard = BackwardGuard()


class FabricModule(Module):
    """Wraps the strategy's module (e.g. DDP) and the user's original module.

    ``forward`` casts floating inputs to the precision's dtype, runs under the precision's forward context and
    casts floating outputs back. Attributes, ``state_dict`` and ``load_state_dict`` act on the original module,
    so checkpoints have no wrapper prefixes.
    """

    def __init__(self, forward_module: Module, strategy: Strategy, original_module: Module | None = None) -> None:
        super().__init__()
        self._forward_module = forward_module
        # `is None`, not `or`: an empty nn.Sequential/ModuleList is falsy.
        self._original_module = original_module if original_module is not None else forward_module
        self._strategy = strategy
        self._forward_methods = set(_DEFAULT_FORWARD_METHODS)
        # Both modules also sit in the instance __dict__ (beside `_modules`, which keeps them registered), so
        # `self._forward_module` is a plain attribute read instead of two `__getattr__` calls per forward.
        self.__dict__["_forward_module"] = forward_module
        self.__dict__["_original_module"] = self._original_module
        # The direct call in `__call__` skips `forward`, so only for this class's own `forward` (not a subclass's).
        self.__dict__["_can_call_directly"] = _CAN_CALL_DIRECTLY and type(self).forward is FabricModule.forward
        self._plan(strategy)
        self._fabric_module_initialized = True

    @property
    def module(self) -> Module:
        return self._original_module

    @property
    def strategy_module(self) -> Module:
        """What the strategy set up (e.g. the DDP or FSDP module), without the ``torch.compile`` wrapper that
        ``setup`` re-applies on top of it for a model compiled before ``setup``: what strategies receive."""
        forward_module = self._forward_module
        return forward_module._orig_mod if _is_compiled(forward_module) else forward_module

    def _plan(self, strategy: Strategy) -> FastPaths:
        """Decide the plan for ``strategy``'s current precision object. ``_direct`` is the same plan where
        ``__call__`` may skip ``nn.Module.__call__`` and ``forward`` altogether, else ``None``: one read per call."""
        d = self.__dict__
        paths = d["_paths"] = FastPaths(strategy)
        d["_direct"] = paths if paths.forward and d["_can_call_directly"] else None
        return paths

    def _current_paths(self) -> FastPaths:
        """The plan for the strategy's current precision object (a new one if it was replaced)."""
        d = self.__dict__
        paths = d["_paths"]
        if d["_strategy"].configured_precision is not paths.precision:
            paths = self._plan(d["_strategy"])
        return paths

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """On the plain path, skip the wrapper's own ``nn.Module.__call__`` (three frames on every step).

        Only when that call would do nothing but ``forward``: no hooks on the wrapper or module-wide, no
        ``torch.compile`` of the wrapper via ``module.compile()``, no ``forward`` patched on the instance, no JIT
        tracing, and ``nn.Module.__call__`` not replaced. The inner module's own call runs its hooks as usual.
        """
        if goodput.marking:  # the goodput ledger's and hang detector's mark (runtime/goodput.py)
            goodput.on_forward()
        # Read through the instance __dict__: attribute loads on a Module (which has `__getattr__`) are slow.
        d = self.__dict__
        paths = d["_direct"]
        if (
            paths is not None
            and d["_strategy"].configured_precision is paths.precision  # else `forward` decides again
            and not (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"] or d["_backward_hooks"])
            and not (_G_FORWARD_PRE or _G_FORWARD or _G_BACKWARD_PRE or _G_BACKWARD)
            and "_compiled_call_impl" not in d  # set on the instance by `module.compile()`
            and "forward" not in d
            and Module.__call__ is _unpatched_module_call
            and _jit_trace._trace_module_map is None  # no module is being traced (see `_jit_trace`)
        ):
            return d["_forward_module"](*args, **kwargs)
        return Module.__call__(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        paths = self._current_paths()
        if paths.forward:
            return self._forward_module(*args, **kwargs)
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_module(*args, **kwargs)
        output = precision.convert_output(output)
        if paths.guard_outputs:
            apply_to_collection(output, Tensor, backward_guard.attach)
        return output

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self._original_module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, **kwargs)

    def mark_forward_method(self, method: str | Callable) -> None:
        """Route ``model.<method>(...)`` through the strategy's forward (needed when the strategy wraps it)."""
        if not isinstance(method, str) and not inspect.ismethod(method):
            raise TypeError(f"Expected a method or a string, but got: {type(method).__name__}")
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError("You cannot mark the forward method itself as a forward method.")
        if not inspect.ismethod(getattr(self._original_module, name, None)):
            raise AttributeError(
                f"You marked '{name}' as a forward method, but `{type(self._original_module).__name__}.{name}` does"
                " not exist or is not a method."
            )
        self._forward_methods.add(name)

    def _redirect_forward_call(self, name: str) -> Callable:
        """Call ``original.<name>`` *through* the strategy wrapper's forward, so hooks (DDP sync) still run."""
        original = self._original_module
        method = getattr(original, name)

        @wraps(method)
        def call_forward_module(*args: Any, **kwargs: Any) -> Any:
            # An instance-level `forward` shadows the class's; remember whether there was one to put back.
            had_own_forward = "forward" in original.__dict__
            own_forward = original.__dict__.get("forward")

            def restore() -> None:
                if had_own_forward:
                    original.forward = own_forward  # type: ignore[method-assign]
                else:
                    original.__dict__.pop("forward", None)

            def patched(*a: Any, **kw: Any) -> Any:
                restore()  # nested calls of forward inside the method are the real forward again
                return method(*a, **kw)

            original.forward = patched  # type: ignore[method-assign]
            try:
                return self(*args, **kwargs)
            finally:
                restore()

        return call_forward_module

    def _track_submodule_calls(self, name: str) -> Callable:
        """Wrap other methods so calling submodules outside forward (which DDP/FSDP would miss) is caught."""
        method = getattr(self._original_module, name)

        @wraps(method)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            called: list[str] = []
            # The root counts too: `self(x)` inside a method bypasses the strategy wrapper just the same.
            handles = [
                m.register_forward_pre_hook(lambda mod, inp, _n=n: called.append(_n))
                for n, m in self._original_module.named_modules()
            ]
            try:
                result = method(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
            if called:
                cls = type(self._original_module).__name__
                raise RuntimeError(
                    f"You are calling the method `{cls}.{name}()` from outside the model. To avoid issues with the"
                    f" currently selected strategy, explicitly mark it as a forward method with"
                    f" `fabric_model.mark_forward_method({name!r})` after `fabric.setup()`."
                )
            return result

        return tracked

    def __getattr__(self, name: str) -> Any:
        if "_fabric_module_initialized" not in self.__dict__:
            return super().__getattr__(name)
        modules = self.__dict__["_modules"]
        original = modules["_original_module"] if "_original_module" in modules else self.__dict__.get("_original_module")
        forward_module = modules.get("_forward_module")
        if name in self.__dict__.get("_forward_methods", ()) and forward_module is not original:
            return self._redirect_forward_call(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        attr = getattr(original, name)
        if forward_module is not original and inspect.ismethod(attr) and name not in dir(Module):
            return self._track_submodule_calls(name)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        """New names go to the user's module; names the wrapper itself has stay on the wrapper (too).

        A name that exists on the original module is set there, so properties, submodules and flags the user's
        code reads keep working; a name that (also) exists on the wrapper, e.g. ``training``, is set on the
        wrapper as well. ``forward`` and dunders only ever patch the wrapper instance.
        """
        if not self.__dict__.get("_fabric_module_initialized", False):
            return super().__setattr__(name, value)
        if name in _MIRRORED:
            super().__setattr__(name, value)  # (re)registers a module in `_modules`, drops the __dict__ copy
            if isinstance(value, Module):
                self.__dict__[name] = value
            if name == "_strategy":
                self._plan(value)
            return None
        if name.startswith("__") or name == "forward":
            return super().__setattr__(name, value)
        original = self._original_module
        on_wrapper = (
            name in self.__dict__
            or hasattr(type(self), name)
            or any(name in self.__dict__[d] for d in ("_parameters", "_buffers", "_modules"))
        )
        on_original = hasattr(original, name)
        if on_original or not on_wrapper:
            setattr(original, name, value)
        if on_wrapper:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _MIRRORED and name in self.__dict__ and name in self.__dict__["_modules"]:
            del self.__dict__[name]  # the copy beside `_modules`; Module.__delattr__ removes the registration
        super().__delattr__(name)

    @property
    def device(self) -> torch.device:
        for t in self._original_module.parameters():
            return t.device
        for t in self._original_module.buffers():
            return t.device
        return self._strategy.root_device

    @property
    def dtype(self) -> torch.dtype:
        for t in self._original_module.parameters():
            return t.dtype
        return torch.get_default_dtype()

    @dtype.setter
    def dtype(self, value: Any) -> None:
        raise RuntimeError("Cannot set the dtype explicitly. Please use module.to(new_dtype).")


#: Wrapper attributes kept in the instance __dict__ for fast access (modules also stay in `_modules`).
_MIRRORED = frozenset({"_forward_module", "_original_module", "_strategy"})


def _own_attribute(name: str, getter: Callable[[Any], Any]) -> property:
    """``wrapped.<name>`` always resolves on the wrapper, whatever the shared ``__dict__`` holds.

    The wrapper shares the optimizer's ``__dict__``, so an instance attribute ``step`` put there by an LR
    scheduler built on the *raw* optimizer would otherwise shadow the wrapper's ``step`` and skip the strategy.
    A property is a data descriptor, which takes precedence over the instance ``__dict__``. An assignment on the
    wrapper (a scheduler built on the *wrapped* optimizer patches ``step``) replaces the property on the
    per-instance class and never reaches the raw optimizer, whose own ``step`` would then call the patch again,
    recursively; ``del`` restores the wrapper's own method. ``getter`` is a C callable: no Python frame per read.
    """

    def assign(obj: Any, value: Any) -> None:
        setattr(type(obj), name, property(lambda _: value, assign, restore))

    def restore(obj: Any) -> None:
        if type(obj).__dict__.get(name) is default:
            raise AttributeError(name)
        setattr(type(obj), name, default)

    default = property(getter, assign, restore)
    return default


def _own_attributes(cls: type) -> dict[str, property]:
    attributes = {}
    for name in ("step", "zero_grad", "state_dict", "load_state_dict"):
        function = getattr(cls, name)
        if name in ("zero_grad", "load_state_dict") and function is getattr(FabricOptimizer, name):
            # These only forward to the optimizer: hand out its bound method, which saves a frame per call.
            attributes[name] = _own_attribute(name, attrgetter(f"_optimizer.{name}"))
        else:
            attributes[name] = _own_attribute(name, partial(MethodType, function))
    return attributes


class FabricOptimizer:
    """Makes ``optimizer.step()`` go through the strategy (and precision); everything else is the optimizer's.

    The instance's class is a dynamic subclass of both this class and the optimizer's class, so
    ``isinstance(wrapped, torch.optim.SGD)`` still holds.
    """

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> None:
        # Share state, param_groups, defaults ... with the real optimizer, also after `load_state_dict` replaces
        # them. The wrapper's own references live on its per-instance class, so nothing leaks into the user's
        # optimizer (whose __dict__ this is): it stays picklable and free of a reference to the strategy.
        cls = self.__class__
        namespace: dict[str, Any] = {
            "_optimizer": optimizer,
            "_strategy": strategy,
            "_callbacks": callbacks if callbacks is not None else [],
            "_paths": FastPaths(strategy),
        }
        namespace.update(_own_attributes(cls))
        self.__dict__ = optimizer.__dict__
        self.__class__ = type("Fabric" + type(optimizer).__name__, (cls, type(optimizer)), namespace)

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.get_optimizer_state(self._optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def step(self, closure: Callable | None = None) -> Any:
        strategy = self._strategy
        paths = self._paths
        if strategy.configured_precision is not paths.precision:  # a replaced precision: decide again
            paths = type(self)._paths = FastPaths(strategy)  # the per-instance class, not the optimizer's __dict__
        if not paths.step:
            kwargs = {"closure": closure} if closure is not None else {}
            target = strategy.optimizer_step_target
            target = target(self._optimizer) if target is not None else self._optimizer
            output = strategy.optimizer_step(target, **kwargs)
        else:  # the strategy's step would only call `optimizer.step()`
            target = self._optimizer
            output = target.step() if closure is None else target.step(closure=closure)
        for callback in self._callbacks:
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=strategy, optimizer=target)
        if _ledger.open_ledger is not None:  # FABRIC_SAMPLE_LEDGER: the batches handed out since are trained ...
            _ledger.open_ledger.settle(strategy.samples_trained())  # ... unless the strategy says otherwise
        if goodput.marking:  # the step is over: the goodput ledger and the hang detector (runtime/goodput.py)
            goodput.on_step()
        return output

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._optimizer.zero_grad(*args, **kwargs)


class FabricDataLoader:
    """Moves each batch to the device and calls ``set_epoch`` on the sampler at the start of every epoch.

    ``state_dict()``/``load_state_dict()`` make it a stateful object for ``fabric.save``/``fabric.load``: the state
    holds the epoch counter that feeds ``set_epoch``, the seed of a ``DistributedSampler`` in the loader, and, when
    the wrapped loader is stateful itself (torchdata's ``StatefulDataLoader``), the wrapped loader's state. A loader
    saved in the middle of an epoch continues that epoch, with the same ``set_epoch`` number, where it stopped.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device | None = None, *, record_samples: bool = True) -> None:
        """``record_samples``: whether this process writes the batches it hands out to the sample ledger (one process
        of those that share a data-parallel rank does: tensor, pipeline and sequence peers train the same samples)."""
        self.__dict__.update(dataloader.__dict__)
        self._dataloader = dataloader
        self._device = device
        self._num_iter_calls = 0
        self._exhausted_epoch = -1  # the last epoch whose iteration ran to its end
        self._continues_loaded_epoch = False  # the next __iter__ continues an epoch loaded from a checkpoint
        self._position = 0  # global position reached in the epoch iterated last (a global order's loader)
        self._loaded_position = 0  # where a loaded epoch continues
        book = _ledger.active()  # FABRIC_SAMPLE_LEDGER: the loader's name there, by the order of setup
        name = book.name_loader() if book is not None else None  # named on every process: the same name everywhere
        self._ledger_name = name if record_samples else None

    @property
    def device(self) -> torch.device | None:
        return self._device

    def __len__(self) -> int:
        return len(self._dataloader)

    def _samplers(self) -> list[Any]:
        found: list[Any] = []
        batch_sampler = getattr(self._dataloader, "batch_sampler", None)
        for sampler in (getattr(self._dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if sampler is not None and all(sampler is not other for other in found):
                found.append(sampler)
        return found

    def _set_epoch(self, epoch: int) -> None:
        for sampler in self._samplers():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Generator[Any, None, None]:
        epoch = self._num_iter_calls
        self._num_iter_calls += 1
        continues = self._continues_loaded_epoch
        self._continues_loaded_epoch = False
        if self._device is None:
            return self._iterate(epoch, continues)
        start = partial(self._start_epoch, epoch, continues)
        return iterate_moved(start, self._device, partial(self._end_epoch, epoch))

    def _start_epoch(self, epoch: int, continues: bool = False) -> Iterator:
        self._set_epoch(epoch)
        order = self._global_order()
        if order is not None:
            order.set_start(self._loaded_position if continues else 0)
            self._position = order.start
        if continues:
            # A DataLoader draws its base seed from torch's global generator when an epoch's iterator is made. The
            # run that saved drew it when the epoch began, before the checkpoint; drawing it again on resuming would
            # shift every random number after it (dropout, augmentations) against the run that never stopped.
            with torch.random.fork_rng(devices=[]):
                iterator = iter(self._dataloader)
        else:
            iterator = iter(self._dataloader)
        return iterator if order is None else self._follow(iterator, order)

    def _follow(self, iterator: Iterator, order: GlobalOrderSampler) -> Generator[Any, None, None]:
        """Hand out the batches, keeping the global position they reach (one step record per batch, see
        :mod:`fabric_core.utilities.global_order`) and telling the sample ledger, when there is one."""
        book = _ledger.active() if self._ledger_name is not None else None
        size = order.size
        for batch in iterator:
            step = order.next_drawn()
            if step is not None:
                self._position = step.end
                if book is not None:
                    book.handed_out(self._ledger_name, step, size)  # type: ignore[arg-type]
            yield batch

    def _end_epoch(self, epoch: int) -> None:
        self._exhausted_epoch = epoch

    def _iterate(self, epoch: int, continues: bool = False) -> Generator[Any, None, None]:
        yield from self._start_epoch(epoch, continues)
        self._exhausted_epoch = epoch

    # ------------------------------------------------------------------------------------------------ state
    def _resume_epoch(self) -> int:
        """The epoch the next ``__iter__`` continues: an unfinished one, or the one after the last finished."""
        started = self._num_iter_calls
        if started == 0 or self._exhausted_epoch == started - 1:
            return started
        return started - 1

    def _distributed_sampler(self) -> Any | None:
        return next((s for s in self._samplers() if isinstance(s, DistributedSampler)), None)

    def _global_order(self) -> GlobalOrderSampler | None:
        from fabric_core.utilities.global_order import GlobalOrderSampler

        return next((s for s in self._samplers() if isinstance(s, GlobalOrderSampler)), None)

    def _mid_epoch(self) -> bool:
        started = self._num_iter_calls
        return self._continues_loaded_epoch or (started > 0 and self._exhausted_epoch != started - 1)

    @property
    def global_batch_size(self) -> int | None:
        """The samples one step trains on over every data-parallel rank (``None`` without a global order)."""
        order = self._global_order()
        return order.global_batch_size() if order is not None else None

    @property
    def share_weight(self) -> float:
        """The factor for this rank's mean loss that makes data-parallel averaging the global batch's mean (1.0 unless a
        fixed ``global_batch_size`` does not divide by the number of ranks; see docs/decisions.md, "Elastic training")."""
        order = self._global_order()
        return order.share_weight() if order is not None else 1.0

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: ``fabric_epoch``, ``fabric_sampler_seed`` and the wrapped loader's own state.

        ``fabric_epoch`` is the epoch the loader continues with after loading: the one in progress if iteration
        stopped before its end, else the next one; ``fabric_mid_epoch`` says which. ``dataloader`` is present when
        the wrapped loader has a ``state_dict`` (a plain ``DataLoader`` has none; it restarts the saved epoch from
        its beginning). With a global order (:mod:`fabric_core.utilities.global_order`, what ``setup_dataloaders``
        gives a data-parallel loader) ``fabric_position`` is the global position reached in that epoch, the samples
        every rank together consumed, and ``fabric_order`` what the order depends on; loading continues from there on
        any number of ranks, with any loader (plain or stateful).
        """
        mid_epoch = self._mid_epoch()
        state: dict[str, Any] = {"fabric_epoch": self._resume_epoch(), "fabric_mid_epoch": mid_epoch}
        sampler = self._distributed_sampler()
        if sampler is not None:
            state["fabric_sampler_seed"] = int(sampler.seed)
        order = self._global_order()
        if order is not None:
            position = (self._loaded_position if self._continues_loaded_epoch else self._position) if mid_epoch else 0
            state["fabric_position"] = position
            state["fabric_order"] = order.describe()
        inner = getattr(self._dataloader, "state_dict", None)
        if callable(inner):
            state["dataloader"] = inner()
        return state

    def checkpoint_state(self) -> tuple[Any, dict[str, Any] | None]:
        """What ``fabric.save`` stores, in the reference's layout: under the loader's key the wrapped loader's own
        ``state_dict()`` (the reference saves the unwrapped loader), and apart (``__fabric_extra__``) the epoch
        counter and sampler seed. A loader without state of its own is stored as :meth:`state_dict`."""
        state = self.state_dict()
        if "dataloader" not in state:
            return state, None
        inner = state.pop("dataloader")
        return inner, state

    def load_checkpoint_state(self, entry: Any, extra: dict[str, Any] | None) -> None:
        """Restore what :meth:`checkpoint_state` stored; ``extra`` is ``None`` for a checkpoint of the reference
        (the wrapped loader's state alone: the epoch counter stays)."""
        if extra is not None and isinstance(entry, dict) and "fabric_epoch" not in entry:
            self.load_state_dict({**extra, "dataloader": entry})
        else:
            self.load_state_dict(entry)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; a wrapped loader's own state (as saved unwrapped) works too."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"`FabricDataLoader.load_state_dict` expects the dict `state_dict()` returned, got a"
                f" {type(state_dict).__name__}."
            )
        if "fabric_epoch" not in state_dict:
            # The wrapped loader's own state, e.g. saved from the unwrapped loader: the epoch counter stays.
            with torch.random.fork_rng(devices=[]):
                self._load_inner(state_dict)
            return
        order = self._global_order()
        by_position = order is not None and "fabric_position" in state_dict
        mid_epoch = bool(state_dict.get("fabric_mid_epoch"))
        if by_position:
            # The global position says where every rank continues, on any number of ranks. The wrapped loader's own
            # state (torchdata's) counts this rank's batches of the saving run's shares: it is not loaded, or it
            # would skip them a second time.
            self._check_order(order, state_dict)
        elif "dataloader" in state_dict:
            with torch.random.fork_rng(devices=[]):  # loading a position draws no random numbers of the run
                self._load_inner(state_dict["dataloader"])
        # Only a stateful loader, or a global order, continues the saved epoch where it stopped (a plain one restarts it).
        self._continues_loaded_epoch = mid_epoch and (by_position or "dataloader" in state_dict)
        sampler = self._distributed_sampler()
        if sampler is not None and "fabric_sampler_seed" in state_dict:
            sampler.seed = int(state_dict["fabric_sampler_seed"])
        epoch = int(state_dict["fabric_epoch"])
        self._num_iter_calls = epoch
        self._exhausted_epoch = epoch - 1
        self._loaded_position = int(state_dict["fabric_position"]) if by_position and mid_epoch else 0
        # Samplers get the epoch (and a global order its start) now as well, in case the wrapped loader materialises
        # its iterator before the next ``__iter__`` (torchdata's does in ``state_dict()``).
        self._set_epoch(epoch)
        if order is not None:
            order.set_start(self._loaded_position)
            book = _ledger.active() if self._ledger_name is not None else None
            if book is not None and by_position:
                book.resumed(self._ledger_name, epoch, self._loaded_position, order.size)  # type: ignore[arg-type]

    @staticmethod
    def _check_order(order: GlobalOrderSampler, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("fabric_order") or {}
        size = saved.get("size")
        if size is not None and int(size) != order.size:
            raise ValueError(
                f"The checkpoint's loader position belongs to an epoch of {size} samples, but this loader's has"
                f" {order.size}: the dataset (or the loader's sampler) changed. Resume with the dataset the checkpoint"
                " was saved with, or load the checkpoint with `strict=False` and leave the loader's key out."
            )

    def _load_inner(self, state: Any) -> None:
        load = getattr(self._dataloader, "load_state_dict", None)
        if not callable(load):
            raise TypeError(
                f"The checkpoint holds the state of a stateful dataloader, but the `{type(self._dataloader).__name__}`"
                " set up here has no `load_state_dict`. Load it into the same kind of loader it was saved from (e.g."
                " torchdata's `StatefulDataLoader`), or load the checkpoint with `strict=False` and leave this"
                " key out of the state you pass to `fabric.load`."
            )
        load(state)


def unwrap_compiled(obj: Any) -> tuple[Any, dict[str, Any] | None]:
    """Return the module inside a ``torch.compile`` wrapper and the arguments it was compiled with.

    A compiled module may carry its arguments in ``_fabric_compile_kwargs`` (set it when you build the wrapper
    yourself); otherwise they are read back from the compiled wrapper. The arguments are ``None`` for an
    uncompiled object, and also when they cannot be determined (the returned module then differs from ``obj``).
    """
    if not _is_compiled(obj):
        return obj, None
    kwargs = getattr(obj, "_fabric_compile_kwargs", None)
    if kwargs is None:
        kwargs = _compile_kwargs_from_dynamo(obj)
    return obj._orig_mod, dict(kwargs) if kwargs is not None else None


def _compile_kwargs_from_dynamo(obj: Any) -> dict[str, Any] | None:
    """Recover the ``torch.compile`` arguments from a compiled wrapper, without patching torch at import.

    The backend sits at the end of a chain of dynamo callbacks linked by ``_torchdynamo_orig_backend``; torch's
    own backend wrappers keep what ``mode``/``options``/``dynamic`` turned into. Returns ``None`` when the
    structure is not recognised (a torch version that changed it).
    """
    context = getattr(obj, "dynamo_ctx", None)
    backend = getattr(context, "callback", None)
    for _ in range(16):
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    if backend is None or not callable(backend):
        return None
    kwargs: dict[str, Any] = {}
    kind = type(backend).__name__
    if kind == "_TorchCompileInductorWrapper":
        kwargs["backend"] = "inductor"
        config = getattr(backend, "config", None)
        if config:
            kwargs["options"] = dict(config)  # what `mode` and `options` resolved to
    elif kind == "_TorchCompileWrapper":
        name = getattr(backend, "compiler_name", None)
        compiler_fn = getattr(backend, "compiler_fn", None)
        if compiler_fn is None:
            return None
        kwargs["backend"] = name if isinstance(name, str) and _is_registered_backend(name, compiler_fn) else compiler_fn
        kwargs.update(getattr(backend, "kwargs", None) or {})  # `mode` / `options` given with a custom backend
    else:
        kwargs["backend"] = backend
    dynamic = getattr(backend, "dynamic", None)
    if dynamic is None:
        dynamic = getattr(context, "_dynamic", None)
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    if getattr(context, "fullgraph", False):
        kwargs["fullgraph"] = True
    return kwargs


def _is_registered_backend(name: str, compiler_fn: Any) -> bool:
    try:
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(name) is compiler_fn
    except (ImportError, RuntimeError):  # a torch without that registry, or an unknown name (InvalidBackend)
        return False


def is_wrapped(obj: object) -> bool:
    """Whether ``obj`` was returned by one of Fabric's ``setup`` methods (looks through ``torch.compile``)."""
    if _is_compiled(obj):
        obj = obj._orig_mod  # type: ignore[attr-defined]
    return isinstance(obj, (FabricModule, FabricOptimizer, FabricDataLoader))


def unwrap_objects(collection: Any, *, dataloaders: bool = True) -> Any:
    """Replace wrappers by what the strategy works with (e.g. the DDP module, the raw optimizer).

    With ``dataloaders=False`` a ``FabricDataLoader`` stays as it is: checkpoints save it through its own
    ``state_dict``, which carries the epoch counter beside the wrapped loader's state.
    """

    def unwrap(obj: Any) -> Any:
        if _is_compiled(obj):
            obj = obj._orig_mod
        if isinstance(obj, FabricModule):
            return obj.strategy_module
        if isinstance(obj, FabricOptimizer):
            return obj.optimizer
        if isinstance(obj, FabricDataLoader) and dataloaders:
            return obj._dataloader
        return obj

    types = (FabricModule, FabricOptimizer, FabricDataLoader, Module)
    if isinstance(collection, dict):
        return {
            k: unwrap_objects(v, dataloaders=dataloaders) if isinstance(v, (dict, list, tuple)) else unwrap(v)
            for k, v in collection.items()
        }
    if isinstance(collection, (list, tuple)) and not isinstance(collection, types):
        return type(collection)(unwrap(v) for v in collection)
    return unwrap(collection)
