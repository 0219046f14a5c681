"""An exponential moving average (EMA) of a model's weights, for every strategy, sharded ones included.

``ema = EMA(model, decay=0.999)`` after ``fabric.setup``; ``ema.update()`` after each ``optimizer.step()``;
``with ema.average_parameters(): evaluate(model)`` runs the model with the averaged weights and puts the trained
ones back. Put ``ema`` in the state given to ``fabric.save``/``fabric.load``: it is a stateful object, and a load
restores it exactly.

How it stays correct for every strategy: the averages live beside the parameters in the parameters' own layout. A
replicated parameter (single device, DDP) has a replicated average; a sharded one (an FSDP2 or tensor-parallel
DTensor) has a DTensor average with the same mesh and placements, so each rank updates only its shard, with no
communication and no full copy in memory. FSDP2 modules are resharded before the parameters are read or written
(a forward leaves the root's gathered weights in place until the next backward), so the block's forward gathers
the averages and the next forward after it gathers the trained weights again. ``state_dict`` gathers whole tensors (collective: every rank saves, as
``fabric.save`` calls it) so a checkpoint holds the full averages whatever the strategy; ``load_state_dict`` lays
them out again like the parameters, so a checkpoint of one strategy loads into another. Parameters that an engine
keeps outside the module (DeepSpeed ZeRO-3's partitions) are not supported.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

__all__ = ["EMA"]


def _named_parameters(model: Module) -> Iterator[tuple[str, Parameter]]:
    """The trainable parameters under the user's names, sharded ones in their sharded (stepped) form."""
    from fabric_core.utilities.dtensor import reshard
    from fabric_core.wrappers import FabricModule, unwrap_compiled

    model, _ = unwrap_compiled(model)
    module = model.module if isinstance(model, FabricModule) else model  # the user's names, whatever the wrapping
    reshard(module)
    return ((name, p) for name, p in module.named_parameters() if p.requires_grad)


class EMA:
    """``average = decay * average + (1 - decay) * weights`` at each :meth:`update`, per trainable parameter.

    Args:
        model: the model (set up by Fabric, or a plain module).
        decay: how much of the average each update keeps, in ``[0, 1)``.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update, so the average follows the weights
            closely early in training instead of holding on to the initial weights.
    """

    def __init__(self, model: Module, decay: float = 0.999, *, warmup: bool = False) -> None:
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 <= decay < 1.0:
            raise ValueError(f"`EMA(decay=...)` must be a number in [0, 1), got {decay!r} (0.999 is common).")
        self.model = model
        self.decay = float(decay)
        self.warmup = warmup
        self.num_updates = 0
        self.averages: dict[str, Tensor] = {name: p.detach().clone() for name, p in _named_parameters(model)}
        if not self.averages:
            raise ValueError(f"`EMA(model)`: the {type(model).__name__} has no trainable parameters to average.")

    def current_decay(self) -> float:
        """The decay the next :meth:`update` applies."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    @torch.no_grad()
    def update(self) -> None:
        """Move the averages towards the current weights (call it after ``optimizer.step()``)."""
        weight = 1.0 - self.current_decay()
        averages, params = [], []
        for name, p in _named_parameters(self.model):
            averages.append(self.averages[name])
            params.append(p.detach())
        torch._foreach_lerp_(averages, params, weight)
        self.num_updates += 1

    @contextmanager
    def average_parameters(self) -> Generator[None, None, None]:
        """Run the block with the averaged weights in the model (to evaluate or save them), then restore the trained
        ones exactly."""
        params = dict(_named_parameters(self.model))
        trained = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.averages[name])
        try:
            yield
        finally:
            params = dict(_named_parameters(self.model))  # resharded again: the block's forward gathered averages
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(trained[name])

    def state_dict(self) -> dict[str, Any]:
        """The averages as whole tensors (gathers sharded ones: call it on every rank), the decay and the count."""
        from fabric_core.utilities.dtensor import full_state

        averages = full_state(self.averages)
        return {"averages": {k: v.detach().cpu() for k, v in averages.items()}, "decay": self.decay, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the averages (laid out like the parameters, sharded ones included), the decay and the count."""
        from fabric_core.utilities.dtensor import is_dtensor, shard_like

        given = state["averages"]
        missing, unexpected = set(self.averages) - set(given), set(given) - set(self.averages)
        if missing or unexpected:
            raise KeyError(
                f"The EMA state does not match the model: missing averages for {sorted(missing)}, unexpected"
                f" {sorted(unexpected)}. Load the EMA of the same model."
            )
        with torch.no_grad():
            for name, current in self.averages.items():
                value = given[name]
                if is_dtensor(current):
                    self.averages[name] = shard_like(value, current)
                else:
                    current.copy_(value)
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])
