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
        self._original_module = original_module or forward_module
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
        method = getattr(self._original_module, name)
        original_forward = self._original_module.forward

        @wraps(method)
        def call_forward_module(*args: Any, **kwargs: Any) -> Any:
            def patched(*a: Any, **kw: Any) -> Any:
                self._original_module.forward = original_forward  # type: ignore[method-assign]
                return method(*a, **kw)

            self._original_module.forward = patched  # type: ignore[method-assign]
            try:
                return self(*args, **kwargs)
            finally:
                self._original_module.forward = original_forward  # type: ignore[method-assign]

        return call_forward_module

    def _track_submodule_calls(self, name: str) -> Callable:
        """Wrap other methods so calling submodules outside forward (which DDP/FSDP would miss) is caught."""
        method = getattr(self._original_module, name)

        @wraps(method)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            called: list[str] = []
            handles = [
                m.register_forward_pre_hook(lambda mod, inp, _n=n: called.append(_n))
                for n, m in self._original_module.named_modules()
                if n
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
        original = self.__dict__["_modules"].get("_original_module") or self.__dict__.get("_original_module")
        forward_module = self.__dict__["_modules"].get("_forward_module")
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
        if not self.__dict__.get("_fabric_module_initialized", False):
            return super().__setattr__(name, value)
        original = self._original_module
        if name.startswith("__") or (hasattr(self, name) and not hasattr(original, name)) or name in self.__dict__:
            return super().__setattr__(name, value)
        setattr(original, name, value)

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
        self.__dict__ = optimizer.__dict__  # share state, param_groups, defaults ... with the real optimizer
        self._optimizer = optimizer
        self._strategy = strategy
        self._callbacks = callbacks or []
        self.__class__ = type("Fabric" + type(optimizer).__name__, (self.__class__, type(optimizer)), {})

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
    """Return the module inside a ``torch.compile`` wrapper and the arguments it was compiled with."""
    if not _is_compiled(obj):
        return obj, None
    kwargs = getattr(obj, "_fabric_compile_kwargs", None)
    if kwargs is None:
        kwargs = _compile_kwargs_from_dynamo(obj)
    return obj._orig_mod, kwargs


def _compile_kwargs_from_dynamo(obj: Any) -> dict[str, Any]:
    """Recover ``torch.compile`` arguments from the compiled wrapper without patching torch at import."""
    kwargs: dict[str, Any] = {}
    callback = getattr(obj, "_torchdynamo_orig_callable", None) or getattr(obj, "dynamo_ctx", None)
    compiler = getattr(callback, "_torchdynamo_orig_backend", callback)
    backend = getattr(compiler, "compiler_name", None) or getattr(compiler, "name", None)
    if isinstance(backend, str):
        kwargs["backend"] = backend
    return kwargs


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
