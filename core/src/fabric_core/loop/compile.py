"""Compile each repeated block of a model (each Transformer layer, say) instead of the whole model.

``compile_blocks(model)`` before ``fabric.setup(model, ...)``. Each block is compiled in place: its ``forward``
becomes a ``torch.compile``-d function, while the module objects, their names and their parameters stay what they
were, so every strategy wraps them as it wraps an eager model. FSDP2 shards the same block objects (its hooks run
around the compiled forward, not inside it), activation checkpointing applies to them, and a checkpoint's keys are
unchanged. (Not ``Module.compile()``: dynamo skips that for torch's own module classes, such as
``nn.TransformerEncoderLayer``, which then silently run eager; the forward is compiled through a function of this
module instead, which dynamo traces into any class.)

Why blocks and not the whole model: the blocks are the same code, so dynamo compiles one graph and reuses it for
every layer (compile time does not grow with depth), and what cannot be traced (data-dependent Python between the
layers, hooks of a strategy) stays outside the compiled code instead of splitting one big graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn import Module, ModuleDict, ModuleList, Sequential

__all__ = ["compile_blocks", "is_compiled_block", "repeated_blocks"]

BlockSpec = type[Module] | tuple[type[Module], ...] | Callable[[Module], bool] | None


def repeated_blocks(model: Module) -> list[tuple[str, Module]]:
    """The members of containers (``ModuleList``, ``Sequential``, ``ModuleDict``) whose class occurs at least twice
    in their container: the layers of a Transformer's ``ModuleList``, outermost containers first."""
    found: list[tuple[str, Module]] = []
    taken: set[int] = set()
    for name, container in model.named_modules():
        if not isinstance(container, (ModuleList, Sequential, ModuleDict)) or id(container) in taken:
            continue
        children = list(container.named_children())
        counts: dict[type, int] = {}
        for _, child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        for child_name, child in children:
            if counts[type(child)] >= 2 and not isinstance(child, (ModuleList, Sequential, ModuleDict)):
                found.append((f"{name}.{child_name}" if name else child_name, child))
                taken.update(id(m) for m in child.modules())
    return found


def _select(model: Module, blocks: BlockSpec) -> list[tuple[str, Module]]:
    if blocks is None:
        return repeated_blocks(model)
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        classes = blocks
        return [(n, m) for n, m in model.named_modules() if isinstance(m, classes) and m is not model]
    if callable(blocks):
        return [(n, m) for n, m in model.named_modules() if m is not model and blocks(m)]
    raise TypeError(
        f"`compile_blocks(model, blocks=...)` takes a module class, a tuple of them or a predicate `fn(module) -> bool`,"
        f" got a {type(blocks).__name__}."
    )


def compile_blocks(model: Module, blocks: BlockSpec = None, **compile_kwargs: Any) -> list[str]:
    """Compile each block of ``model`` in place with ``torch.compile(**compile_kwargs)``; returns the blocks' names.

    Args:
        model: the model, before ``fabric.setup``.
        blocks: which submodules: a class (or tuple of classes), or a predicate; by default the repeated members of
            the model's ``ModuleList``/``Sequential`` containers (:func:`repeated_blocks`).
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ...).
    """
    selected = _select(model, blocks)
    if not selected:
        what = "no submodule matches `blocks`" if blocks is not None else "it has no repeated blocks in a ModuleList or Sequential"
        raise ValueError(
            f"`compile_blocks` found nothing to compile in the {type(model).__name__}: {what}. Name the block class,"
            " e.g. `compile_blocks(model, blocks=TransformerBlock)`, or compile the whole model with `torch.compile`."
        )
    outer: list[tuple[str, Module]] = []
    for name, block in selected:  # a block inside another selected block is compiled with it
        if not any(name.startswith(other + ".") for other, _ in outer):
            outer.append((name, block))
    import functools

    import torch

    # One compiled function for every block, the block passed as an argument: dynamo treats the blocks' parameters
    # as inputs, so blocks of one class share one graph (no compile per layer, no recompile limit at depth > 8).
    compiled = torch.compile(_block_forward, **compile_kwargs)
    for _, block in outer:
        block.forward = functools.partial(compiled, block)  # type: ignore[method-assign]
    return [name for name, _ in outer]


def _block_forward(block: Module, *args: Any, **kwargs: Any) -> Any:
    return type(block).forward(block, *args, **kwargs)


def is_compiled_block(module: Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``."""
    forward = vars(module).get("forward")
    return getattr(getattr(forward, "func", None), "_torchdynamo_orig_callable", None) is _block_forward
