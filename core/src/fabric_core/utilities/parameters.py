"""Optimizers over parameters that a strategy replaced while setting up their model.

Sharding a model (DTensor sharding, FSDP2's ``fully_shard``, materialising meta weights) replaces its parameter
objects. An optimizer created before still holds the old ones and would never update the model. ``fabric.setup``
therefore records the model's parameters by their place (:func:`record_parameters`) before the strategy sets it up,
finds what was replaced (:func:`replaced_parameters`) afterwards, and points the optimizers at the new objects
(:func:`rewire_optimizer`), or refuses with what to do when that is impossible.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

#: Parameters replaced by a setup: id(old parameter) -> weak references to it and to the parameter now in its place
#: (weak both ways: remembering a replacement keeps neither model alive).
Replacements = dict[int, tuple[weakref.ref, weakref.ref]]
#: Where each parameter of a model lives: (owning module, attribute name, parameter).
ParameterPlaces = list[tuple[Module, str, Parameter]]


def record_parameters(module: Module) -> ParameterPlaces:
    """Every parameter of ``module`` with the submodule and attribute that hold it."""
    return [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items() if p is not None]


def replaced_parameters(places: ParameterPlaces) -> Replacements:
    """The recorded parameters whose place now holds another parameter object."""
    replaced: Replacements = {}
    for owner, name, old in places:
        new = owner._parameters.get(name)
        if new is not None and new is not old:
            replaced[id(old)] = (weakref.ref(old), weakref.ref(new))
    return replaced


def rewire_optimizer(optimizer: Optimizer, replaced: Replacements) -> int:
    """Point ``optimizer`` at the parameters that replaced the ones it was built over, in place; returns how many.

    Refused (``RuntimeError``) for an optimizer that already has state for a replaced parameter: that state belongs
    to the old tensor's layout.
    """
    count = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            entry = replaced.get(id(p))
            new = entry[1]() if entry is not None and entry[0]() is p else None
            if new is None:
                continue
            if optimizer.state.get(p):
                raise RuntimeError(
                    "The optimizer already has state for parameters that the strategy replaced while setting up the"
                    " model (it has taken a step). Create the optimizer fresh, after `fabric.setup_module(model)`,"
                    " from the set-up model's parameters, and set it up with `fabric.setup_optimizers(optimizer)`."
                )
            params[i] = new  # in place: optimizers such as LBFGS keep a reference to this list
            count += 1
    return count


def optimizer_parameters(optimizer: Optimizer) -> Iterable[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def check_optimizer_updates(optimizer: Any, index: int, module: Module, strategy_name: str, method: str) -> None:
    """``ValueError`` when ``optimizer`` updates none of ``module``'s parameters after the strategy set it up.

    It did before (``fabric.setup`` checks that first), so the strategy moved the parameters somewhere
    :func:`replaced_parameters` cannot follow (a wrapper that flattens them, say).
    """
    own = [id(p) for p in optimizer_parameters(optimizer)]
    params = {id(p) for p in module.parameters()}
    if own and params and not any(i in params for i in own):
        raise ValueError(
            f"Optimizer {index} passed to `fabric.{method}` updates none of the model's parameters after"
            f" `{strategy_name}` set the model up: the strategy replaced them in a way Fabric cannot follow, so the"
            " model would never train. Set up the model first, `model = fabric.setup_module(model)`, create the"
            " optimizer from `model.parameters()`, then `optimizer = fabric.setup_optimizers(optimizer)`."
        )
