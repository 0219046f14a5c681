"""``Float8Precision``: float8 matmuls in every eligible Linear layer, through torchao's float8 training."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module

from fabric_core.precision import Precision
from fabric_core.utilities import import_package, missing_package, rank_zero_info, rank_zero_warn

#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: fabric-ao's requirement of torchao (its pyproject.toml; tests/test_dependencies.py keeps them equal)
TORCHAO_REQUIREMENT = "torchao>=0.18.0,<0.19"


def import_torchao(module: str = "torchao") -> Any:
    """A torchao module, or an ``ImportError`` that gives the install line."""
    return import_package(module, "fabric-ao", f'pip install "{TORCHAO_REQUIREMENT}"')


def _float8_capable() -> bool:
    """A CUDA device with float8 matmuls (compute capability 8.9: Ada, Hopper and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


class Float8Precision(Precision):
    """Float8 training: every Linear layer whose dimensions are multiples of 16 becomes torchao's ``Float8Linear``
    (inputs, weights and gradients cast to float8 with dynamic scales for the matmuls; weights, gradients and
    optimizer state stay in their dtype). Other layers are left alone, with a warning naming them.

    On a GPU with float8 support (compute capability 8.9+) the matmuls run in float8; elsewhere, on the CPU
    included, they are emulated: the same float8 casts and scales, the matmul in high precision (slower than the
    plain model, the numerics of float8).

    The precision only rewrites the model's modules, so it composes with a strategy that owns its precision
    (FSDP: give the strategy its ``mixed_precision`` policy for bf16 parameters) and runs before
    ``ModelParallelStrategy``'s ``parallelize_fn``.

    Args:
        recipe: ``"tensorwise"`` (default), ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (torchao's recipes).
        emulate: ``True`` to emulate the float8 matmuls, ``False`` for real ones (a GPU with float8 support),
            ``None`` (default): real where the device has them, else emulated.
        module_filter_fn: ``fn(module, fqn) -> bool``, which Linear layers to convert (torchao's filter).
            Default: those with both dimensions multiples of 16; the others are skipped with a warning.
        enable_fsdp_float8_all_gather: FSDP2 all-gathers the weights in float8 (tensorwise recipe only); the
            scales for the next step are computed for all weights at once after every ``optimizer.step()``.
        pad_inner_dim: pad the inner dimension of the matmuls to a multiple of 16 (torchao's option).
    """

    precision = "float8"
    transforms_modules_only = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``fabric plugins --check``: torchao missing, with the install line (nothing imported)."""
        return missing_package("torchao", f'pip install "{TORCHAO_REQUIREMENT}"')

    def __init__(
        self,
        recipe: str = "tensorwise",
        emulate: bool | None = None,
        module_filter_fn: Callable[[Module, str], bool] | None = None,
        enable_fsdp_float8_all_gather: bool = False,
        pad_inner_dim: bool = False,
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"`Float8Precision(recipe={recipe!r})` is not a torchao recipe. Valid: {', '.join(RECIPES)}.")
        if enable_fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"`enable_fsdp_float8_all_gather=True` needs the 'tensorwise' recipe (torchao's rule), not {recipe!r}."
            )
        if module_filter_fn is not None and not callable(module_filter_fn):
            raise TypeError(f"`module_filter_fn` must be a callable `fn(module, fqn) -> bool`, got {module_filter_fn!r}.")
        import_torchao("torchao.float8")  # fail here, with the install line, not at setup
        self.recipe = recipe
        self.emulate = emulate
        self.module_filter_fn = module_filter_fn
        self.enable_fsdp_float8_all_gather = enable_fsdp_float8_all_gather
        self.pad_inner_dim = pad_inner_dim
        self._modules: list[weakref.ref[Module]] = []

    def configure(self, device_type: str) -> None:
        capable = device_type == "cuda" and _float8_capable()
        if self.emulate is False and not capable:
            raise ValueError(
                "`Float8Precision(emulate=False)` needs a CUDA GPU with float8 matmuls (compute capability 8.9+),"
                f" this run uses {device_type!r}. Pass `emulate=True` (or leave it unset) to emulate float8 here."
            )
        if self.emulate is None:
            self.emulate = not capable
        if self.emulate:
            rank_zero_info(f"float8 training emulated on {device_type!r}: float8 numerics, high-precision matmuls")

    def config(self) -> Any:
        """The ``torchao.float8.Float8LinearConfig`` this precision converts with."""
        import dataclasses

        from torchao.float8 import Float8LinearConfig

        base = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(
            base,
            emulate=bool(self.emulate),
            enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
            pad_inner_dim=self.pad_inner_dim,
        )

    # ---------------------------------------------------------------------------------------- module
    def convert_module(self, module: Module) -> Module:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        if isinstance(module, torch.nn.Linear):
            raise TypeError(
                "`Float8Precision` swaps the Linear layers inside a model, and the model itself is one: wrap it in"
                " a container (`torch.nn.Sequential(layer)`)."
            )
        if not any(isinstance(m, Float8Linear) for m in module.modules()):
            filter_fn = self.module_filter_fn or self._default_filter(module)
            places = {f"{owner_name}.{name}": (owner, name, p) for owner_name, owner in module.named_modules()
                      for name, p in owner._parameters.items() if p is not None}  # fmt: skip
            convert_to_float8_training(module, module_filter_fn=filter_fn, config=self.config())
            # the swapped-out layers' places now hold the new parameters (the float8 all-gather wrapper is a new
            # Parameter): fabric.setup then points optimizers built before setup at them
            for owner_name, owner in module.named_modules():
                for name, new in owner._parameters.items():
                    old = places.get(f"{owner_name}.{name}")
                    if old is not None and new is not None and old[2] is not new:
                        old[0]._parameters[old[1]] = new
        if not any(isinstance(m, Float8Linear) for m in module.modules()):
            rank_zero_warn(f"`{self!r}` converted no Linear layer of the model: it trains in full precision.")
        self._modules.append(weakref.ref(module))
        return module

    def _default_filter(self, module: Module) -> Callable[[Module, str], bool]:
        skipped = [
            f"{name} ({m.in_features}->{m.out_features})"
            for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and (m.in_features % 16 or m.out_features % 16)
        ]
        if skipped:
            rank_zero_warn(
                f"Float8 training skips {len(skipped)} Linear layer(s) whose dimensions are not multiples of 16"
                f" (float8 matmuls need them): {', '.join(skipped)}. They train in the model's dtype."
            )

        def eligible(m: Module, fqn: str) -> bool:
            return isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0

        return eligible

    # ---------------------------------------------------------------------------------------- step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        result = optimizer.step(**kwargs)
        if self.enable_fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # one all-reduce for the scales of every float8 weight, instead of one per weight in the next forward
            for ref in self._modules:
                module = ref()
                if module is not None:
                    precompute_float8_dynamic_scale_for_fsdp(module)
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}(recipe={self.recipe!r}, emulate={self.emulate})"
