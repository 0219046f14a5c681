"""``TransformerEnginePrecision``: NVIDIA Transformer Engine's float8 layers (``precision="transformer-engine"``).

Transformer Engine needs a CUDA GPU and the ``transformer_engine`` package, which has no CPU build: where either
is missing, building this precision says which one and how to get it. The layer swap and ``fp8_autocast`` below
follow Transformer Engine's documented API; they run only on such a GPU (the GPU lane), not in the CPU tests.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch.nn import Module

from fabric_core.precision import DefaultDtype, Precision
from fabric_core.utilities import missing_package, rank_zero_warn

#: what to install: Transformer Engine's PyTorch extension builds against the installed CUDA torch
TE_INSTALL = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def import_transformer_engine() -> Any:
    """``transformer_engine.pytorch``, or an ``ImportError`` saying how to install it."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ModuleNotFoundError(
            f"`precision='transformer-engine'` needs NVIDIA Transformer Engine, which could not be imported ({err})."
            f" It runs on CUDA GPUs only; install it on such a machine with `{TE_INSTALL}` (see"
            " https://github.com/NVIDIA/TransformerEngine#installation). On other machines, `precision='float8'`"
            " (fabric-ao, torchao) trains with float8 numerics, emulated where the device has no float8 matmuls."
        ) from err


class TransformerEnginePrecision(Precision):
    """Float8 training with Transformer Engine (the reference's ``TransformerEnginePrecision``).

    Linear layers (dimensions multiples of 16 and 8) and LayerNorms become Transformer Engine's, the model is cast
    to ``weights_dtype``, and the forward pass runs under ``fp8_autocast`` (with ``torch.autocast`` in
    ``fallback_compute_dtype`` for the other operations).

    Args:
        weights_dtype: ``torch.bfloat16``/``torch.float16``/``torch.float32`` (or its name).
        recipe: a ``transformer_engine.common.recipe`` object, a dict of ``DelayedScaling`` arguments, or ``None``
            for ``DelayedScaling(fp8_format=HYBRID, amax_history_len=16, amax_compute_algo="max")``.
        replace_layers: swap Linear/LayerNorm layers for Transformer Engine's (default ``True``).
        fallback_compute_dtype: autocast dtype of what float8 does not cover (default: ``weights_dtype``).
    """

    precision = "transformer-engine"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What this machine lacks for Transformer Engine (``fabric plugins --check`` shows it); nothing imported."""
        missing = missing_package("transformer_engine", TE_INSTALL, note=" (CUDA GPUs only)")
        if missing is not None:
            return missing
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (Transformer Engine has no CPU kernels); `precision='float8'` runs here"
        return None

    def __init__(
        self,
        weights_dtype: torch.dtype | str = torch.bfloat16,
        recipe: Any = None,
        replace_layers: bool | None = None,
        fallback_compute_dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(weights_dtype, str):
            if weights_dtype not in _DTYPES:
                raise ValueError(f"`weights_dtype` must be one of {sorted(_DTYPES)}, got {weights_dtype!r}.")
            weights_dtype = _DTYPES[weights_dtype]
        self.te = import_transformer_engine()
        if not torch.cuda.is_available():
            raise RuntimeError(
                "`precision='transformer-engine'` needs a CUDA GPU (Transformer Engine has no CPU kernels) and"
                " none is available. On this machine use `precision='float8'` (fabric-ao: torchao float8 training,"
                " emulated without a float8 GPU)."
            )
        if recipe is None or isinstance(recipe, dict):
            from transformer_engine.common.recipe import DelayedScaling, Format

            options = {"fp8_format": Format.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"}
            options.update(recipe or {})
            if isinstance(options["fp8_format"], str):
                options["fp8_format"] = getattr(Format, options["fp8_format"].upper())
            recipe = DelayedScaling(**options)
        self.weights_dtype = weights_dtype
        self.recipe = recipe
        self.replace_layers = replace_layers is not False
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self.input_dtype = self.fallback_compute_dtype
        if weights_dtype == torch.float16:
            self.precision = "transformer-engine-float16"

    def configure(self, device_type: str) -> None:
        if device_type != "cuda":
            raise ValueError(f"`precision={self.precision!r}` runs on CUDA GPUs only, this run uses {device_type!r}.")

    def convert_module(self, module: Module) -> Module:
        if self.replace_layers:
            self._replace(module)
        return module.to(dtype=self.weights_dtype)

    def _replace(self, module: Module) -> None:
        te = self.te
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                if child.in_features % 8 or child.out_features % 16:
                    rank_zero_warn(
                        f"Transformer Engine skips Linear {name!r} ({child.in_features}->{child.out_features}):"
                        " float8 needs in_features divisible by 8 and out_features by 16."
                    )
                    continue
                new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(module, name, new)
            elif type(child) is torch.nn.LayerNorm and child.elementwise_affine:
                new = te.LayerNorm(child.normalized_shape[0], eps=child.eps)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    new.bias.copy_(child.bias)
                setattr(module, name, new)
            else:
                self._replace(child)

    def tensor_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.weights_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return DefaultDtype(self.weights_dtype)

    def forward_context(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(DefaultDtype(self.fallback_compute_dtype))
        stack.enter_context(torch.autocast("cuda", dtype=self.fallback_compute_dtype))
        stack.enter_context(self.te.fp8_autocast(enabled=True, fp8_recipe=self.recipe))
        return stack
