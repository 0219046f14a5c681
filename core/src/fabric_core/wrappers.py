"""What ``fabric.setup*`` returns: thin wrappers around the user's module, optimizers and dataloaders.

They stay out of the hot path: the module wrapper adds one precision-context enter/exit and two tree walks
only when the precision converts dtypes; the optimizer wrapper forwards ``step`` to the strategy; the
dataloader wrapper moves each batch. Nothing here imports ``torch._dynamo``: compiled modules are detected by
class name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from functools import wraps
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fabric_core.utilities.apply import apply_to_collection, move_data_to_device

if TYPE_CHECKING:
    from fabric_core.strategies.base import Strategy

_DEFAULT_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_in_fabric_backward = False


def _is_compiled(obj: Any) -> bool:
    return type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")


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
        self._fabric_module_initialized = True

    @property
    def module(self) -> Module:
        return self._original_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_module(*args, **kwargs)
        output = precision.convert_output(output)
        if self._strategy.requires_fabric_backward:
            apply_to_collection(output, Tensor, _guard_backward)
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


def _guard_backward(tensor: Tensor) -> Tensor:
    if tensor.requires_grad and tensor.grad_fn is not None:
        tensor.register_hook(_check_fabric_backward)
    return tensor


def _check_fabric_backward(grad: Tensor) -> Tensor:
    if not _in_fabric_backward:
        raise RuntimeError(
            "The current strategy and precision selection requires you to call `fabric.backward(loss)` instead of"
            " `loss.backward()`."
        )
    return grad


class fabric_backward_scope(AbstractContextManager):
    """Marks the duration of ``fabric.backward`` so the guard above can tell the two paths apart."""

    def __enter__(self) -> None:
        global _in_fabric_backward
        self._previous = _in_fabric_backward
        _in_fabric_backward = True

    def __exit__(self, *exc: Any) -> None:
        global _in_fabric_backward
        _in_fabric_backward = self._previous


class FabricOptimizer:
    """Makes ``optimizer.step()`` go through the strategy (and precision); everything else is the optimizer's.

    The instance's class is a dynamic subclass of both this class and the optimizer's class, so
    ``isinstance(wrapped, torch.optim.SGD)`` still holds.
    """

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> None:
        # Share state, param_groups, defaults ... with the real optimizer, also after `load_state_dict` replaces
        # them. The wrapper's own references live on its per-instance class, so nothing leaks into the user's
        # optimizer (whose __dict__ this is): it stays picklable and free of a reference to the strategy.
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            "Fabric" + type(optimizer).__name__,
            (self.__class__, type(optimizer)),
            {"_optimizer": optimizer, "_strategy": strategy, "_callbacks": callbacks if callbacks is not None else []},
        )

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.get_optimizer_state(self._optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def step(self, closure: Callable | None = None) -> Any:
        kwargs = {"closure": closure} if closure is not None else {}
        target = getattr(self._strategy, "optimizer_step_target", None)
        target = target(self._optimizer) if callable(target) else self._optimizer
        output = self._strategy.optimizer_step(target, **kwargs)
        for callback in self._callbacks:
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=self._strategy, optimizer=target)
        return output

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._optimizer.zero_grad(*args, **kwargs)


class FabricDataLoader:
    """Moves each batch to the device and calls ``set_epoch`` on the sampler at the start of every epoch."""

    def __init__(self, dataloader: DataLoader, device: torch.device | None = None) -> None:
        self.__dict__.update(dataloader.__dict__)
        self._dataloader = dataloader
        self._device = device
        self._num_iter_calls = 0

    @property
    def device(self) -> torch.device | None:
        return self._device

    def __len__(self) -> int:
        return len(self._dataloader)

    def _set_epoch(self, epoch: int) -> None:
        seen: set[int] = set()
        samplers = [getattr(self._dataloader, "sampler", None)]
        batch_sampler = getattr(self._dataloader, "batch_sampler", None)
        samplers.append(getattr(batch_sampler, "sampler", None))
        for sampler in samplers:
            if sampler is None or id(sampler) in seen:
                continue
            seen.add(id(sampler))
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Generator[Any, None, None]:
        epoch = self._num_iter_calls
        self._num_iter_calls += 1
        return self._iterate(epoch)

    def _iterate(self, epoch: int) -> Generator[Any, None, None]:
        self._set_epoch(epoch)
        iterator: Iterator = iter(self._dataloader)
        device = self._device
        if device is None:
            yield from iterator
            return
        for batch in iterator:
            yield move_data_to_device(batch, device)


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
    except Exception:
        return False


def is_wrapped(obj: object) -> bool:
    """Whether ``obj`` was returned by one of Fabric's ``setup`` methods (looks through ``torch.compile``)."""
    if _is_compiled(obj):
        obj = obj._orig_mod  # type: ignore[attr-defined]
    return isinstance(obj, (FabricModule, FabricOptimizer, FabricDataLoader))


def unwrap_objects(collection: Any) -> Any:
    """Replace wrappers by what the strategy works with (e.g. the DDP module, the raw optimizer)."""

    def unwrap(obj: Any) -> Any:
        if _is_compiled(obj):
            obj = obj._orig_mod
        if isinstance(obj, FabricModule):
            return obj._forward_module if not _is_compiled(obj._forward_module) else obj._forward_module._orig_mod
        if isinstance(obj, FabricOptimizer):
            return obj.optimizer
        if isinstance(obj, FabricDataLoader):
            return obj._dataloader
        return obj

    types = (FabricModule, FabricOptimizer, FabricDataLoader, Module)
    if isinstance(collection, dict):
        return {k: unwrap_objects(v) if isinstance(v, (dict, list, tuple)) else unwrap(v) for k, v in collection.items()}
    if isinstance(collection, (list, tuple)) and not isinstance(collection, types):
        return type(collection)(unwrap(v) for v in collection)
    return unwrap(collection)
