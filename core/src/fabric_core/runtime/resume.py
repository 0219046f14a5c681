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

import hashlib
import math
import random
from typing import Any, Protocol

import torch

from fabric_core.io.location import CheckpointLocation
from fabric_core.io.series import CheckpointSeries
from fabric_core.utilities.rank_zero import rank_zero_info


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


def _data_parallel(fabric: Any) -> tuple[int, int]:
    """This process's data-parallel rank and the data-parallel size (the topology's; the strategy's before it had
    one; the global rank and world size for anything else that has ranks)."""
    for holder in (getattr(fabric, "topology", None), getattr(fabric, "strategy", None)):
        rank, size = getattr(holder, "data_parallel_rank", None), getattr(holder, "data_parallel_size", None)
        if isinstance(rank, int) and isinstance(size, int):
            return rank, size
    return fabric.global_rank, fabric.world_size


def checkpoint_key(ranks: dict[str, Any]) -> bytes:
    """A digest of every rank's saved generators: the same on every rank that loads the checkpoint, and another one
    for every checkpoint."""
    digest = hashlib.blake2b(b"fabric-random-states", digest_size=16)
    for name in sorted(ranks):
        raw = ranks[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(name.encode())
        digest.update(raw.numpy().tobytes() if _numpy() is not None else bytes(raw.tolist()))
    return digest.digest()


def resized_seed(key: bytes, data_parallel_rank: int) -> int:
    """The seed of data-parallel rank ``data_parallel_rank`` after a resume at another size (a 63-bit integer):
    ``blake2b(key, rank)``, where ``key`` is :func:`checkpoint_key` of the checkpoint's generators."""
    digest = hashlib.blake2b(key + int(data_parallel_rank).to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_generators(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (if NumPy is there) and torch's CPU and CUDA generators."""
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device's generator too


class RandomStates:
    """Every rank's random generators (Python's ``random``, NumPy's global one, torch's CPU and CUDA generators) as
    one entry of a checkpoint: ``state["rng"] = RandomStates(fabric)``.

    Dropout, random augmentations and the order of a shuffled ``RandomSampler`` draw from these, differently on each
    rank; a run resumed without them continues with other random numbers than the uninterrupted run would have.
    ``state_dict()`` gathers the generators of all ranks (a collective, as ``fabric.save`` is: every rank saves),
    stored as tensors so the safe loader reads them, with the data-parallel layout they were saved at;
    ``load_state_dict()`` gives each rank its own back.

    A checkpoint of another layout (world size or data-parallel size: an elastic resume on more or fewer ranks) has
    no generator meant for a given rank. Each rank is then seeded (every generator above) with
    :func:`resized_seed` ``(checkpoint_key(saved generators), data-parallel rank)``: a function of the checkpoint and
    of the rank's data-parallel coordinate alone, so a resume is reproducible, ranks draw different numbers, processes
    that share a data-parallel rank (tensor- or pipeline-parallel peers, which see the same samples) draw the same ones,
    and no rank replays the numbers of the run before. docs/decisions.md, "Elastic training", describes the mapping.
    """

    def __init__(self, fabric: _Ranks) -> None:
        self._fabric = fabric

    def state_dict(self) -> dict[str, Any]:
        fabric = self._fabric
        rank, size = _data_parallel(fabric)
        captured = _capture()
        captured["data_parallel_rank"] = torch.tensor(rank)
        gathered = fabric.all_gather(captured)
        # one process's all_gather may add no rank dimension (a single device's does not, a 1-process group's does)
        gathered = {k: v.unsqueeze(0) if v.dim() == captured[k].dim() else v for k, v in gathered.items()}
        return {
            "world_size": fabric.world_size,
            "data_parallel_size": size,
            "ranks": {key: value.cpu() for key, value in gathered.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        fabric = self._fabric
        saved = int(state_dict["world_size"])
        rank, size = _data_parallel(fabric)
        saved_size = int(state_dict.get("data_parallel_size", saved))
        ranks = dict(state_dict["ranks"])
        ranks.pop("data_parallel_rank", None)
        if saved != fabric.world_size or saved_size != size:
            seed_generators(resized_seed(checkpoint_key(ranks), rank))
            rank_zero_info(
                f"The checkpoint holds the random generators of {saved} ranks ({saved_size} data-parallel), this run"
                f" has {fabric.world_size} ({size}): every rank's generators are seeded from the checkpoint and its"
                " data-parallel rank (`fabric_core.runtime.resume.resized_seed`)."
            )
            return
        # Own copies: a loaded checkpoint's tensors may be views into a memory-mapped file, and torch's generators
        # read a state tensor's storage from its start.
        _restore({key: value[fabric.global_rank].clone() for key, value in ranks.items()})

    def __repr__(self) -> str:
        return f"RandomStates(world_size={self._fabric.world_size})"


__all__ = ["RandomStates", "checkpoint_key", "find_latest_checkpoint", "resized_seed", "seed_generators"]
