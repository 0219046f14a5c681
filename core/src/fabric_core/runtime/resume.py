"""Resuming a run: the newest complete checkpoint of a series, and every rank's random generators.

The pattern (also in docs/decisions.md, "Resuming")::

    state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0}
    latest = fabric.latest_checkpoint("ckpts/step-*.ckpt")   # the same on every rank; None on a first run
    if latest is not None:
        fabric.load(latest, state)                           # in place; state["step"] is the saved step
    while state["step"] < max_steps:
        ...
        state["step"] += 1
        if state["step"] % 100 == 0:
            fabric.save(f"ckpts/step-{state['step']:08d}.ckpt", state, keep_last=3)

It works the same after a crash, a preemption, or an elastic restart (``fabric run --max-restarts N``): the restarted
script finds the checkpoint the failed attempt committed last and continues from it. What a checkpoint restores is
what was put in ``state``: the loader's position (a set-up dataloader; mid-epoch with torchdata's
``StatefulDataLoader``, from the start of the saved epoch with a plain ``DataLoader``), the random generators
(:class:`RandomStates`), the step, anything with ``state_dict``/``load_state_dict``.

:func:`find_latest_checkpoint` reads the series where it is, locally or at a URL, by the one rule of
:class:`fabric_core.io.series.CheckpointSeries` (which ``keep_last`` prunes by, too).
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any, Protocol

import torch

from fabric_core.io.location import CheckpointLocation
from fabric_core.io.series import CheckpointSeries


class _Ranks(Protocol):
    """What :class:`RandomStates` uses of a ``Fabric``."""

    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    def all_gather(self, data: Any) -> Any: ...


def find_latest_checkpoint(series: Any) -> CheckpointLocation | None:
    """The newest complete checkpoint of a numbered series, or ``None`` when it has none yet.

    ``series`` is the members' name with ``*`` for their number (``"ckpts/step-*.ckpt"``,
    ``"s3://bucket/run/epoch-*"``) or the path of any member (``"ckpts/step-100.ckpt"``: its numbers become ``*``),
    as ``fabric.save(..., keep_last=K)`` understands a series. Members are ordered by their numbers, not by time.
    Hidden entries (saves in progress, what a prune is deleting) are never members, nor is a folder on an object
    store whose save did not commit. Reads only: call it on one rank (``fabric.latest_checkpoint`` does) so every
    rank resumes from the same checkpoint.
    """
    return CheckpointSeries.of(series).latest()


# ---------------------------------------------------------------------------------------------------- random state
def _capture() -> dict[str, Any]:
    """This process's generators as tensors and numbers (safe for ``fabric.load``'s ``weights_only`` loader)."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "python_version": torch.tensor(version),
        "python": torch.tensor(words, dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        if kind == "MT19937":
            state["numpy"] = torch.tensor([int(k) for k in keys], dtype=torch.int64)
            state["numpy_pos_gauss"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
            state["numpy_cached"] = torch.tensor(cached, dtype=torch.float64)
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _restore(state: dict[str, Any]) -> None:
    gauss = float(state["python_gauss"])
    random.setstate((int(state["python_version"]), tuple(int(w) for w in state["python"]), None if math.isnan(gauss) else gauss))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        pos, has_gauss = (int(v) for v in state["numpy_pos_gauss"])
        keys = numpy.array([int(k) for k in state["numpy"]], dtype=numpy.uint32)
        numpy.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy_cached"])))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(list(state["cuda"].to(torch.uint8).cpu()))


def _numpy() -> Any | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class RandomStates:
    """Every rank's random generators (Python's ``random``, NumPy's global one, torch's CPU and CUDA generators) as
    one entry of a checkpoint: ``state["rng"] = RandomStates(fabric)``.

    Dropout, random augmentations and the order of a shuffled ``RandomSampler`` draw from these, differently on each
    rank; a run resumed without them continues with other random numbers than the uninterrupted run would have.
    ``state_dict()`` gathers the generators of all ranks (a collective, as ``fabric.save`` is: every rank saves),
    stored as tensors so the safe loader reads them; ``load_state_dict()`` gives each rank its own back. A
    checkpoint of another world size cannot say which generator a rank should get: the ranks keep theirs, with a
    warning.
    """

    def __init__(self, fabric: _Ranks) -> None:
        self._fabric = fabric

    def state_dict(self) -> dict[str, Any]:
        fabric = self._fabric
        gathered = fabric.all_gather(_capture())
        if fabric.world_size == 1:  # all_gather adds no rank dimension for a single process
            gathered = {key: value.unsqueeze(0) for key, value in gathered.items()}
        return {"world_size": fabric.world_size, "ranks": {key: value.cpu() for key, value in gathered.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        fabric = self._fabric
        saved = int(state_dict["world_size"])
        if saved != fabric.world_size:
            warnings.warn(
                f"The checkpoint holds the random generators of {saved} ranks, but this run has {fabric.world_size}:"
                " each rank keeps its current generators (call `fabric.seed_everything` to choose them).",
                stacklevel=2,
            )
            return
        rank = fabric.global_rank
        # Own copies: a loaded checkpoint's tensors may be views into a memory-mapped file, and torch's generators
        # read a state tensor's storage from its start.
        _restore({key: value[rank].clone() for key, value in state_dict["ranks"].items()})

    def __repr__(self) -> str:
        return f"RandomStates(world_size={self._fabric.world_size})"


__all__ = ["RandomStates", "find_latest_checkpoint"]
