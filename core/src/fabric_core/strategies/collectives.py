"""How the processes of a job talk: one axis of a strategy, apart from where they are (:mod:`.layout`).

Three kinds, each a small class a strategy lists first among its bases (before the layout or ``Strategy``):

* :class:`OneProcessCollectives`: one process (one device, or one SPMD program over several): every collective is
  an identity.
* :class:`~fabric_core.strategies.parallel.ProcessGroupCollectives`: a ``torch.distributed`` process group.
* fabric-xla's ``XLACollectives``: XLA replicas.

What every kind shares lives here once: which reductions are accepted (:func:`check_reduce_op`), which ``src`` a
broadcast accepts (:func:`check_broadcast_src`), and the boolean vote built on ``all_reduce``
(:meth:`Collectives.reduce_boolean_decision`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fabric_core.strategies.base import check_reduce_op

__all__ = ["Collectives", "OneProcessCollectives", "check_broadcast_src", "check_reduce_op"]


def check_broadcast_src(src: Any, world_size: int) -> None:
    """``ValueError`` unless ``src`` is a rank of the world (``0 <= src < world_size``)."""
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world_size:
        if world_size == 1:
            raise ValueError(f"`broadcast(src={src!r})`: there is one process, rank 0; `src` must be 0.")
        raise ValueError(f"`broadcast(src={src!r})`: `src` must be a rank between 0 and {world_size - 1}.")


class Collectives:
    """What the kinds of collectives share; they implement ``all_gather``, ``all_reduce``, ``barrier`` and
    ``broadcast``, and :meth:`validate_reduce_op` says which reductions they accept."""

    world_size: int
    root_device: torch.device

    def validate_reduce_op(self, reduce_op: str | Any) -> str | Any:
        """The reduction's canonical name (or the ``ReduceOp`` given); ``ValueError`` for one not accepted."""
        return check_reduce_op(reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether every process (``all=True``) or any process decided ``True``: a sum over ``all_reduce``."""
        if self.world_size == 1:
            return decision
        votes = self.all_reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")  # type: ignore[attr-defined]
        total = int(votes.item())
        return total == self.world_size if all else total > 0


class OneProcessCollectives(Collectives):
    """The collectives of a strategy that runs one process (one device, or one SPMD program over several): every
    one is an identity. Override :meth:`validate_reduce_op` to accept fewer reductions."""

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``tensor`` itself: the only process's contribution."""
        return tensor

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        """``tensor`` itself (after checking ``reduce_op``): a reduction over one process."""
        self.validate_reduce_op(reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` itself; ``src`` must be 0."""
        check_broadcast_src(src, 1)
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The only process's decision."""
        return decision

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``[obj]``: the only process's object."""
        return [obj]
