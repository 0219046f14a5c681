"""Naming a rank that is persistently slower than the others, from the step marks every rank publishes.

In synchronous data parallel training every rank's step takes the same wall time: the slow rank's extra time
shows up on the others as waiting inside their first collective. So the signal is each rank's time *before* its
first collective in a step: from the end of the previous ``optimizer.step()`` to its first forward (data loading,
user code; sharded strategies gather parameters in the forward) and to its first backward (plus the forward; DDP
reduces gradients in the backward). The straggler has the largest; the others wait exactly as much longer.

Every rank publishes its marks in chunks of a few steps through the store (:mod:`fabric_core.runtime.peers`, no
collective); global rank 0's monitor thread compares the ranks chunk by chunk (:class:`StragglerWatch`):

* per chunk and signal, each rank's median over the chunk's steps against the median rank;
* a rank is slow in a chunk when it exceeds the median rank by more than ``max(MIN_EXCESS_S, MIN_SHARE x step)``;
* it is named after :data:`PERSISTENCE` slow chunks in a row (so one scheduling hiccup on a busy machine never
  names anyone), once per episode; it is named again only after it has been normal for as many chunks.

Per step, each rank's waiting time is estimated as the largest rank's signal minus its own (the ledger's
``waiting``). Naming goes to the log, to the loggers (``straggler/...`` metrics, by rank 0) and to every rank's
``on_straggler`` callbacks (``Fabric(callbacks=[...])``), where a straggler may act, for example leave the job.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from fabric_core.runtime import goodput

#: A rank must exceed the median rank by at least this many seconds per step ...
MIN_EXCESS_S = 0.02
#: ... and by this share of the median step time ...
MIN_SHARE = 0.2
#: ... in this many chunks in a row to be named.
PERSISTENCE = 3
SIGNALS = ("before its first forward", "before its first backward")


@dataclass(frozen=True)
class Straggler:
    """A rank named slower than the others (what ``on_straggler`` callbacks receive)."""

    rank: int
    host: str
    slower_s: float  # seconds per step more than the median rank (median over the chunks that named it)
    slower_share: float  # of the median step time
    since_step: int  # the first step of the first slow chunk
    signal: str  # which time was longer ("before its first forward" / "... backward")
    named_at_step: int = -1  # the step global rank 0 had reached when it named the rank

    def message(self) -> str:
        return (
            f"Straggler: rank {self.rank} ({self.host}) is {self.slower_s * 1000:.0f} ms per step slower than the"
            f" median rank ({self.slower_share:.0%} of a step) since step {self.since_step}, in its time"
            f" {self.signal}; the other ranks wait for it in every step."
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class StragglerWatch:
    """Global rank 0's analysis of the published chunks (one per run attempt)."""

    def __init__(self) -> None:
        self.slow_run: dict[int, list[tuple[int, float, float, int]]] = defaultdict(list)  # rank -> slow chunks
        self.normal_run: dict[int, int] = defaultdict(int)
        self.named: set[int] = set()
        self.waiting: dict[int, float] = defaultdict(float)

    def add(self, entries: list[dict[str, Any]], named_at_step: int = -1) -> list[Straggler]:
        """Take one chunk (every rank's entry: ``{"rank", "host", "step", "marks": [[pf, pb, step], ...]}``);
        returns the ranks named by it."""
        by_rank = {int(e["rank"]): e for e in entries if e.get("marks")}
        if len(by_rank) < 2:
            return []
        length = min(len(e["marks"]) for e in by_rank.values())
        if length == 0:
            return []
        step_time = _median([_median([m[2] for m in e["marks"][:length]]) for e in by_rank.values()])
        threshold = max(MIN_EXCESS_S, MIN_SHARE * step_time)
        excess: dict[int, tuple[float, int]] = {}
        spreads = []
        for signal in (0, 1):
            medians = {r: _median([m[signal] for m in e["marks"][:length]]) for r, e in by_rank.items()}
            center = _median(list(medians.values()))
            spreads.append(max(medians.values()) - center)
            for rank, value in medians.items():
                if rank not in excess or value - center > excess[rank][0]:
                    excess[rank] = (value - center, signal)
        # Waiting, per step: the slowest rank's pre-collective time minus this rank's, on the signal that spreads most.
        spread = 0 if spreads[0] >= spreads[1] else 1
        for t in range(length):
            values = {r: e["marks"][t][spread] for r, e in by_rank.items()}
            top = max(values.values())
            for rank, value in values.items():
                self.waiting[rank] += top - value
        named = []
        for rank, entry in by_rank.items():
            over, signal = excess[rank]
            if over > threshold:
                self.slow_run[rank].append((int(entry.get("step", 0)), over, step_time, signal))
                self.normal_run[rank] = 0
                if rank not in self.named and len(self.slow_run[rank]) >= PERSISTENCE:
                    run = self.slow_run[rank]
                    slower = _median([o for _, o, _, _ in run])
                    named.append(
                        Straggler(
                            rank=rank,
                            host=str(entry.get("host", "?")),
                            slower_s=slower,
                            slower_share=slower / max(_median([s for _, _, s, _ in run]), 1e-9),
                            since_step=run[0][0],
                            signal=SIGNALS[_median([float(s) for *_, s in run]) >= 0.5],
                            named_at_step=named_at_step,
                        )
                    )
                    self.named.add(rank)
            else:
                self.slow_run[rank] = []
                self.normal_run[rank] += 1
                if rank in self.named and self.normal_run[rank] >= PERSISTENCE:
                    self.named.discard(rank)  # recovered: name it again if it slows down again
        return named


_announced: set[tuple[int, int]] = set()


def announce(named: list[dict[str, Any]]) -> None:
    """Rank 0 named these (read from the store by every rank's monitor thread): hand the new ones to the main thread,
    which gives them to the ``on_straggler`` callbacks at its next step."""
    for entry in named:
        try:
            straggler = Straggler(**entry)
        except TypeError:
            continue
        key = (straggler.rank, straggler.since_step)
        if key not in _announced:
            _announced.add(key)
            goodput.post_event(straggler)


__all__ = ["MIN_EXCESS_S", "announce", "MIN_SHARE", "PERSISTENCE", "Straggler", "StragglerWatch"]
