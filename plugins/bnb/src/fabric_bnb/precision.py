"""``BitsandbytesPrecision``: Linear layers replaced by bitsandbytes' 4-bit or 8-bit layers, on CPU and CUDA."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch.nn import Module

from fabric_core.precision import DefaultDtype, Precision
from fabric_core.utilities import import_package, missing_package

#: the reference's modes; each is also a registered name ``bnb-<mode>``
MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")
#: fabric-bnb's requirement of bitsandbytes (its pyproject.toml; tests/test_dependencies.py keeps them equal)
BNB_REQUIREMENT = "bitsandbytes>=0.50.2"
#: device types bitsandbytes 0.50 has kernels for
_DEVICES = ("cpu", "cuda", "xpu")


def import_bitsandbytes() -> Any:
    """``bitsandbytes``, or an ``ImportError`` that gives the install line."""
    # its CPU backend logs a warning when the optional `kernels` package is absent; it falls back by itself
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    return import_package("bitsandbytes", "`BitsandbytesPrecision`", f'pip install "{BNB_REQUIREMENT}"')


class BitsandbytesPrecision(Precision):
    """Quantized Linear layers from bitsandbytes (QLoRA's NF4, LLM.int8), with the reference's constructor.

    ``fabric.init_module()`` builds every ``torch.nn.Linear`` as a quantized layer, quantized as it is created
    (so the model never exists whole in full precision); ``fabric.setup()`` replaces the Linear layers of a model
    built outside, one at a time. Other parameters are created in (or cast to) ``dtype``, inputs are cast to
    ``dtype`` and outputs back to torch's default dtype. 4-bit and int8 weights are frozen: train adapters
    (LoRA) beside them; ``int8-training`` keeps trainable float16 weights with int8 matmuls.

    Args:
        mode: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"`` (4-bit, ``-dq``: double quantization),
            ``"int8"`` (frozen int8 weights) or ``"int8-training"``.
        dtype: the dtype of everything that is not quantized and of the 4-bit layers' compute. Default:
            ``float16`` for the int8 modes (the only one they support); for 4-bit ``bfloat16`` on the CPU and on
            GPUs with bfloat16, else ``float16``.
        ignore_modules: names of submodules (as in ``named_modules()``) whose Linear layers stay unquantized;
            only for models set up with ``fabric.setup`` (``init_module`` cannot know the names).
    """

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``fabric plugins --check``: bitsandbytes missing, with the install line (nothing imported)."""
        return missing_package("bitsandbytes", f'pip install "{BNB_REQUIREMENT}"')

    def __init__(
        self,
        mode: str = "nf4",
        dtype: torch.dtype | None = None,
        ignore_modules: set[str] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(
                f"`BitsandbytesPrecision(mode={mode!r})` is not a bitsandbytes mode. Valid modes: {', '.join(MODES)}."
            )
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"`dtype` must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}.")
        if mode.startswith("int8") and dtype not in (None, torch.float16):
            raise ValueError(f"{mode!r} only works with `dtype=torch.float16`, but you chose `{dtype}`.")
        import_bitsandbytes()  # fail here, with the install line, not at setup
        self.mode = mode
        self.precision = f"bnb-{mode}"
        self._dtype = dtype
        self.ignore_modules = set(ignore_modules or ())

    # ---------------------------------------------------------------------------------------- configuration
    def configure(self, device_type: str) -> None:
        if device_type not in _DEVICES:
            raise ValueError(
                f"bitsandbytes quantization (`{self.precision}`) runs on {', '.join(_DEVICES)}, not on {device_type!r}."
                " Use another accelerator, or another precision on this one."
            )
        if self._dtype is None:
            self._dtype = _default_dtype(self.mode, device_type)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of unquantized parameters, of inputs, and of the 4-bit layers' computation."""
        if self._dtype is None:
            self._dtype = _default_dtype(self.mode, "cuda" if torch.cuda.is_available() else "cpu")
        return self._dtype

    @property
    def input_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.dtype

    @property
    def linear_cls(self) -> type[Module]:
        """The layer class that replaces ``torch.nn.Linear`` in this mode."""
        from fabric_bnb.layers import LAYERS

        return LAYERS[self.mode]

    # ---------------------------------------------------------------------------------------- module and init
    def convert_module(self, module: Module) -> Module:
        from fabric_bnb.layers import QUANTIZED

        if not any(isinstance(m, torch.nn.Linear) for m in module.modules()):
            raise TypeError(
                f"`{self!r}` quantizes Linear layers, but the model has none: nothing would be quantized. Use"
                " another precision for this model."
            )
        unknown = self.ignore_modules - {name for name, _ in module.named_modules()}
        if unknown:
            raise ValueError(
                f"`ignore_modules` names modules the model does not have: {sorted(unknown)}. Names are those of"
                " `model.named_modules()`."
            )
        if not any(isinstance(m, QUANTIZED) for m in module.modules()):  # not built under init_module
            self._replace_linears(module)
        quantized = set()
        for m in module.modules():
            if isinstance(m, QUANTIZED):
                quantized.add(id(m.weight))
                if hasattr(m, "compute_dtype"):
                    m.compute_dtype = self.dtype
                    m.compute_type_is_set = True
        # what init_module would have created in `dtype`; `.data` keeps each parameter object (optimizers stay valid)
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in quantized and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor.data = tensor.data.to(self.dtype)
        return module

    def _replace_linears(self, module: Module) -> None:
        cls = self.linear_cls
        for name, child in list(module.named_modules()):
            if name in self.ignore_modules or any(name.startswith(i + ".") for i in self.ignore_modules if i):
                continue
            for child_name, sub in list(child.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if type(sub) is not torch.nn.Linear or full in self.ignore_modules:
                    continue
                with torch.device("meta"):
                    new = cls(sub.in_features, sub.out_features, bias=sub.bias is not None)
                if sub.weight.device.type != "meta":  # on meta it stays empty until a checkpoint is loaded
                    new.quantize_(sub.weight.data, sub.weight.device)  # from the layer's own tensor: no copy kept
                new.bias = sub.bias
                new.train(sub.training)
                setattr(child, child_name, new)
                # point the old place at the new parameter: fabric.setup rewires optimizers built before
                sub._parameters["weight"] = new.weight

    def module_init_context(self) -> AbstractContextManager:
        if self.ignore_modules:
            raise RuntimeError(
                "`fabric.init_module()` with `BitsandbytesPrecision(..., ignore_modules=...)` is not supported: every"
                " Linear layer is quantized as it is built, before its name is known. Build the model outside"
                " `init_module` and pass it to `fabric.setup` (which honours `ignore_modules`), or drop `ignore_modules`."
            )
        stack = ExitStack()
        stack.enter_context(DefaultDtype(self.dtype))
        stack.enter_context(_linear_replaced_by(self.linear_cls))
        return stack

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.dtype)

    def forward_context(self) -> AbstractContextManager:
        return DefaultDtype(self.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, dtype={self._dtype})"


def _default_dtype(mode: str, device_type: str) -> torch.dtype:
    if mode.startswith("int8"):
        return torch.float16
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16  # CPUs compute bfloat16 natively where they compute float16 slowly, if at all


@contextmanager
def _linear_replaced_by(cls: type[Module]) -> Iterator[None]:
    """``torch.nn.Linear`` is ``cls`` inside: models that write ``nn.Linear(...)`` build quantized layers."""
    original = torch.nn.Linear
    torch.nn.Linear = cls  # type: ignore[misc]
    try:
        yield
    finally:
        torch.nn.Linear = original  # type: ignore[misc]
