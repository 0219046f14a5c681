"""A sample order that does not depend on the world size, so a run resumed on another number of ranks loses and
repeats no sample.

An epoch's order is a function of ``(seed, epoch)`` alone: the positions ``0 .. size-1`` of the epoch map to dataset
indices through the same permutation ``DistributedSampler`` draws (``torch.randperm(size)`` seeded with
``seed + epoch``; the identity without shuffling; over a wrapped sampler's order when the loader had a custom
sampler). Training walks the positions in *global batches*: step ``k`` of a pass that starts at position ``P``
covers ``[P + k * G, P + (k + 1) * G)``, and the data-parallel ranks take strided shares of it (share ``s`` of ``S``:
the positions ``start + s, start + s + S, ...``). With the user's per-rank batch ``b`` kept, ``G = b * S``, and a run
that never resizes sees exactly the batches ``DistributedSampler`` gave every rank (same shares, same padding), so
nothing changes for it. What is saved is the epoch and the *global position*, the samples every rank together has
consumed; a run resumed on ``M`` ranks continues from that position with ``M`` shares.

* **Padding.** Every rank must see the same number of batches (a collective waits for each rank). The last global
  batch of a pass is padded with samples from the epoch's start (as ``DistributedSampler`` pads) up to a multiple
  of ``S`` when its shares would otherwise be uneven in count; the pads are the only repeats, and
  :class:`Step.padding` says how many a rank's batch holds (the sample ledger reports them apart).
* **A fixed global batch** (``global_batch_size=G``): ``G`` stays whatever the number of ranks, each rank's batch is
  its share, ``G / S``. When ``S`` does not divide ``G``, the first ``G % S`` shares hold one sample more; every
  sample is still seen once, but data-parallel averaging then weighs each rank's mean alike: multiply each rank's
  mean loss by :meth:`GlobalOrderSampler.share_weight` to make the update the global batch's mean again.
* **Shares from live members** (``membership``): a callable asked once per global batch, returning this process's
  share index and the number of shares *for that batch*; fault-tolerant replica groups (issue 41) pass the quorum.
  With the per-rank batch kept, the global batch then follows the membership batch by batch.
* **A cursor** (``cursor``, a :class:`DataCursor`): where each global batch starts *and* its shares, asked before
  every global batch is drawn, and told every batch the loader hands out. Fault-tolerant replica groups keep the
  position the groups agreed on (a step that was not committed is drawn again; a group that rejoins continues from
  the others' position) instead of the sampler's own walk.

The sampler is an index sampler (``DataLoader(sampler=...)``), so ``loader.sampler`` stays a ``DistributedSampler``
with ``set_epoch``; the loader groups each step's share into one batch, which is why a rank's share of every full step
equals its loader's ``batch_size`` (:meth:`GlobalOrderSampler.share_size`). Each pass records, in draw order, the
:class:`Step` behind every batch it yields, and ``FabricDataLoader`` pops one record per batch it hands out, so it
knows the global position reached (for its ``state_dict``) and which samples a rank trained (for the ledger), also
with workers prefetching ahead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DistributedSampler, Sampler

__all__ = [
    "DataCursor",
    "GlobalOrderSampler",
    "Step",
    "epoch_positions",
    "last_step_length",
    "share_positions",
    "share_size",
]

#: ``membership()`` -> (this process's share index, number of shares), asked once per global batch.
Membership = Callable[[], tuple[int, int]]


def epoch_positions(size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of the positions ``0 .. size-1``: what ``DistributedSampler`` draws, so an unresized run sees
    its batches unchanged."""
    if not shuffle:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def share_size(global_batch: int, share: int, shares: int) -> int:
    """How many of a full global batch's positions share ``share`` of ``shares`` takes (strided cut)."""
    return len(range(share, global_batch, shares))


def share_positions(start: int, end: int, share: int, shares: int) -> range:
    """The positions of ``[start, end)`` that share ``share`` of ``shares`` takes: every ``shares``-th from
    ``start + share`` (the cut ``DistributedSampler`` makes)."""
    return range(start + share, end, shares)


def last_step_length(remaining: int, global_batch: int, shares: int) -> int:
    """How long the last global batch of a pass is once padded: ``remaining`` (< ``global_batch``) positions, padded up to
    a multiple of ``shares`` unless that would give some share more than its full-step size.

    With ``shares`` dividing ``global_batch`` this is ``DistributedSampler``'s rule (pad to a multiple of the number of
    replicas); otherwise a tail longer than ``shares * (global_batch // shares)`` already gives every share at least
    as many positions as the smaller shares of a full step, and is left as it is.
    """
    if remaining > shares * (global_batch // shares):
        return remaining
    return math.ceil(remaining / shares) * shares


@dataclass(frozen=True)
class Step:
    """One global batch, from one rank's point of view: the positions it covers, this rank's samples of it."""

    epoch: int
    start: int
    """The global batch's first position in the epoch."""
    end: int
    """One past its last position, padding excluded: the global position reached once this step is trained."""
    share: int
    shares: int
    indices: tuple[Any, ...]
    """This rank's samples (dataset indices, or what a wrapped sampler yields), pads included (at the end)."""
    padding: int = 0
    """How many of :attr:`indices` are pads (repeats of the epoch's first samples)."""


class DataCursor(Protocol):
    """Where the global batches of a pass start, for samplers whose position is decided outside them (fault-tolerant
    replica groups: the position the groups committed, which a step that was not committed does not move).

    ``plan(epoch, position)`` is asked before each global batch is drawn, with the epoch of the pass and the position
    the sampler would continue at (the end of the batch it drew last, or where the pass began); it returns
    ``(start, share, shares)``: where this global batch starts (``start >= size`` ends the pass) and this process's
    share of it. ``handed_out(step)`` is told every batch the loader hands out, in order (``FabricDataLoader`` hands
    them out; with loader workers they were drawn earlier).
    """

    def plan(self, epoch: int, position: int) -> tuple[int, int, int]: ...

    def handed_out(self, step: Step) -> None: ...


class _Order:
    """The epoch's samples by position: a dataset's indices, or a wrapped sampler's output, then (optionally)
    permuted by :func:`epoch_positions`."""

    def __init__(self, source: Sized | Sampler, wrapped: bool) -> None:
        self.source = source
        self.wrapped = wrapped

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def samples(self, seed: int, epoch: int, shuffle: bool) -> list[Any]:
        positions = epoch_positions(len(self), seed, epoch, shuffle)
        if not self.wrapped:
            return positions
        from fabric_core.utilities.sampler_order import SamplerIndices, wrapped_sampler_seed

        indices = SamplerIndices(self.source)  # type: ignore[arg-type]
        indices.refresh(wrapped_sampler_seed(seed, epoch))
        return [indices[p] for p in positions]


class GlobalOrderSampler(DistributedSampler):
    """This rank's samples of a global order that does not depend on the world size (see the module's description).

    Args:
        source: the dataset (its indices are ordered), or a sampler whose output is ordered (``wrapped=True``: drawn
            inside RNGs seeded from ``(seed, epoch)``, as :class:`~fabric_core.utilities.data.DistributedSamplerWrapper`
            does, so every rank materialises the same order).
        num_replicas, rank: the data-parallel size and this process's data-parallel rank (processes with the same
            rank get the same samples).
        shuffle, seed: as ``DistributedSampler``'s.
        batch_size: the per-rank batch the user's loader has; the global batch is ``batch_size * num_replicas``
            unless ``global_batch_size`` fixes it.
        global_batch_size: keep the global batch at this size whatever the number of ranks (each rank's batch is then
            its share, :meth:`share_size`).
        drop_last: drop an incomplete last global batch (the loader's ``drop_last``), on every rank alike.
        membership: where the shares come from at each global batch (default: ``(rank, num_replicas)``).
        cursor: where each global batch starts and its shares (a :class:`DataCursor`; replaces ``membership``).
    """

    def __init__(
        self,
        source: Sized | Sampler,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
        global_batch_size: int | None = None,
        drop_last: bool = False,
        wrapped: bool = False,
        membership: Membership | None = None,
        cursor: DataCursor | None = None,
    ) -> None:
        order = _Order(source, wrapped)
        super().__init__(order, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
        if global_batch_size is not None:
            check_global_batch_size(global_batch_size, num_replicas)
        self.batch_size = batch_size
        self.fixed_global_batch_size = global_batch_size
        self.global_drop_last = drop_last
        if membership is not None and cursor is not None:
            raise ValueError("Give a `GlobalOrderSampler` `membership` or a `cursor`, not both (a cursor gives the shares).")
        self.membership = membership
        self.cursor = cursor
        self.start = 0
        """The position the next pass over the epoch begins at (set when a loader resumes mid-epoch)."""
        self._drawn: deque[Step] = deque()

    # ------------------------------------------------------------------------------------------------ sizes
    @property
    def size(self) -> int:
        """Samples in an epoch (the dataset's length, or the wrapped sampler's)."""
        return len(self.dataset)  # type: ignore[arg-type]

    def global_batch_size(self, shares: int | None = None) -> int:
        """The global batch with ``shares`` data-parallel shares (default: ``num_replicas``)."""
        if self.fixed_global_batch_size is not None:
            return self.fixed_global_batch_size
        return self.batch_size * (self.num_replicas if shares is None else shares)

    def share_size(self) -> int:
        """This rank's samples in a full global batch: its loader's batch size."""
        return share_size(self.global_batch_size(), self.rank, self.num_replicas)

    def share_weight(self) -> float:
        """What to multiply this rank's mean loss by so that averaging over ranks gives the global batch's mean:
        ``num_replicas * share / global_batch`` (1.0 whenever the shares are equal)."""
        return self.num_replicas * self.share_size() / self.global_batch_size()

    def set_start(self, position: int) -> None:
        """Begin the next pass at ``position`` of the epoch (``0 <= position <= size``)."""
        if not 0 <= int(position) <= self.size:
            raise ValueError(
                f"The loader's saved position {position} is outside this epoch of {self.size} samples: the checkpoint"
                " was saved with another dataset. Load it with the dataset it was saved with."
            )
        self.start = int(position)

    # ------------------------------------------------------------------------------------------------ the plan
    def _shares(self) -> tuple[int, int]:
        if self.membership is None:
            return self.rank, self.num_replicas
        share, shares = self.membership()
        if not 0 <= share < shares:
            raise ValueError(f"membership() returned share {share} of {shares}: a share index is 0 <= index < count.")
        return share, shares

    def _plan(self, position: int) -> tuple[int, int, int]:
        """Where the next global batch starts, and this rank's share of it: the cursor's answer, else ``position``
        with the membership's (or the fixed) shares."""
        if self.cursor is None:
            return (position, 0, 1) if position >= self.size else (position, *self._shares())
        start, share, shares = self.cursor.plan(self.epoch, position)
        if not 0 <= share < shares or start < 0:
            raise ValueError(f"The data cursor planned share {share} of {shares} at {start}: a share index is 0 <= index <"
                             " count, a start is not negative.")  # fmt: skip
        return start, share, shares

    def _global_batches(self, position: int, plan: Callable[[int], tuple[int, int, int]]) -> Iterator[tuple[int, int, int, int]]:
        """``(start, padded length, share, shares)`` of every global batch from ``position`` to the epoch's end;
        ``plan(position)`` says where each one starts and its shares."""
        size = self.size
        while True:
            position, share, shares = plan(position)
            if position >= size:
                return
            global_batch = self.global_batch_size(shares)
            if global_batch < shares:
                raise ValueError(
                    f"The global batch of {global_batch} samples cannot be shared by {shares} data-parallel ranks:"
                    " every rank needs at least one sample per step. Use a global batch at least as large as the"
                    " number of ranks."
                )
            remaining = size - position
            if remaining >= global_batch:
                length = global_batch
            elif self.global_drop_last:
                return
            else:
                length = last_step_length(remaining, global_batch, shares)
            yield position, length, share, shares
            position = min(position + length, size)

    def steps(self, start: int | None = None) -> Iterator[Step]:
        """This rank's steps of the current epoch from ``start`` (default: :attr:`start`), as the next pass draws them."""
        size = self.size
        samples: list[Any] | None = None
        for position, length, share, shares in self._global_batches(self.start if start is None else start, self._plan):
            if samples is None:  # materialised once per pass, when the first batch is drawn
                samples = self.dataset.samples(self.seed, self.epoch, self.shuffle)  # type: ignore[attr-defined]
            picked = share_positions(position, position + length, share, shares)
            indices = tuple(samples[p] if p < size else samples[(p - size) % size] for p in picked)
            padding = sum(1 for p in picked if p >= size)
            yield Step(self.epoch, position, min(position + length, size), share, shares, indices, padding)

    def __iter__(self) -> Iterator[Any]:
        drawn: deque[Step] = deque()
        self._drawn = drawn  # this pass's records; an abandoned pass keeps filling only its own
        for step in self.steps():
            drawn.append(step)
            yield from step.indices

    def __len__(self) -> int:
        """This rank's samples from :attr:`start` to the epoch's end (with ``membership``: if the shares stay as
        ``rank``/``num_replicas`` say). Counted without materialising the order."""
        return sum(
            len(share_positions(position, position + length, share, shares))
            for position, length, share, shares in self._global_batches(
                self.start, lambda position: (position, self.rank, self.num_replicas)
            )
        )

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch here and in a wrapped sampler, so both reshuffle alike on every rank."""
        super().set_epoch(epoch)
        order: _Order = self.dataset  # type: ignore[assignment]
        forward = getattr(order.source, "set_epoch", None) if order.wrapped else None
        if callable(forward):
            forward(epoch)

    def next_drawn(self) -> Step | None:
        """The record of the oldest batch drawn but not yet handed out (``FabricDataLoader`` takes one per batch, as
        it hands the batch out; a cursor is told)."""
        if not self._drawn:
            return None
        step = self._drawn.popleft()
        if self.cursor is not None:
            self.cursor.handed_out(step)
        return step

    def describe(self) -> dict[str, Any]:
        """What the order depends on, saved with the loader's position so a resume can check it is the same order."""
        return {"size": self.size, "seed": int(self.seed), "shuffle": bool(self.shuffle)}


def check_global_batch_size(global_batch_size: Any, shares: int) -> None:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"`global_batch_size` must be a positive integer, got {global_batch_size!r}.")
    if global_batch_size < shares:
        raise ValueError(
            f"`global_batch_size={global_batch_size}` is smaller than the {shares} data-parallel ranks: every rank"
            " needs at least one sample per step. Use a global batch at least as large as the number of ranks."
        )
