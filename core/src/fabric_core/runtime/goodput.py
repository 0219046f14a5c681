"""The goodput ledger: where every second of this rank's wall time went, kept while the run trains.

Every rank attributes its time, from the moment its process started, to one category:

* ``startup``: process start to the end of its first optimizer step (imports, rendezvous, set-up, the first step's
  one-off costs);
* ``productive``: training steps, from one ``optimizer.step()`` to the next, computed for the first time;
* ``redone``: steps computed again after a resume (their number is at most the highest step an earlier attempt
  reached; the checkpoint's step is known from the save record, :meth:`Ledger.record_save`);
* ``checkpoint``: blocking inside ``fabric.save``/``fabric.load``/``latest_checkpoint``;
* ``quorum``: fault-tolerant quorum changes (fabric-ft calls :func:`count_step_as` with ``"quorum"``);
* any section the user declares (``with fabric.section("evaluation"):``), under its own name;
* ``waiting`` (for slower ranks) is a share of the step time that rank 0 estimates from the step marks every rank
  publishes (:mod:`fabric_core.runtime.stragglers`), and ``restart`` and ``other`` are what the report
  (:mod:`fabric_core.runtime.goodput_report`) finds between and around the attempts' records.

The hot path is three calls, made only while :data:`marking` (the wrappers read it): :func:`on_forward` and
:func:`on_backward` note the first forward and backward after a step (the straggler signals: a rank's time before
its first collective), :func:`on_step` closes the step (every few steps it hands a chunk of marks to the monitor
thread through :data:`ready`). Each counts a beat of progress for the hang detector. The per-rank record is written by the monitor thread (:mod:`fabric_core.runtime.hang`) every few seconds into
``<run folder>/goodput/attempt-AAA/rank-RRRRR.json`` (atomic replace), and once more when the process ends.

Only the standard library is imported here.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fabric_core.runtime.run import RunInfo

#: The categories of the report, in its order (user sections come after ``quorum``).
CATEGORIES = ("startup", "productive", "waiting", "checkpoint", "restart", "redone", "quorum", "other")
#: The folder of the ledger inside the run folder.
FOLDER = "goodput"
#: Steps per chunk of step marks that every rank publishes for the straggler analysis (4 up to 1,024 ranks; more
#: beyond, so the store that collects them sees about the same traffic per second).
CHUNK_STEPS = 4
#: How many recent step times the hang detector's median is taken over.
RECENT_STEPS = 101
#: Sections whose names the library uses itself.
CHECKPOINT, QUORUM, EVALUATION = "checkpoint", "quorum", "evaluation"

_clock = time.monotonic
#: Whether the per-step calls note their times (read by the wrappers on every call: one attribute load when off).
marking = False
#: How many per-step calls were made: the hang detector's monitor thread sees progress when it changes (a counter,
#: not a clock read on every call).
beats = 0
#: Whether the hang detector watches this process (it sets this): the marks stay on without a ledger then.
watched = False
_ledger: Ledger | None = None
_injector: Any = None  # fabric chaos's faults for this rank (runtime/chaos.py), when FABRIC_CHAOS names it
#: ``(name, started, hang_limit)`` of the sections the main thread is in, outermost first (also without a ledger:
#: the hang detector reads their limits).
_sections: list[tuple[str, float, float | None]] = []
#: What the monitor thread found for the main thread (a named straggler), delivered at the next step.
events: deque[Any] = deque()
#: Chunks of step marks ``(ledger, index, marks)`` for the monitor thread, which waits on it between its ticks (a C
#: queue: a put costs a tenth of an ``Event.set``).
ready: queue.SimpleQueue[tuple[Any, int, list[tuple[float, float, float]]]] = queue.SimpleQueue()
_event_handler: Callable[[Any], None] | None = None


def chunk_steps(world_size: int) -> int:
    """Steps per published chunk of step marks for ``world_size`` ranks (see :data:`CHUNK_STEPS`)."""
    return CHUNK_STEPS * max(1, -(-world_size // 1024))


class Ledger:
    """This process's accounts (one per process; :func:`start` makes it)."""

    def __init__(
        self,
        info: RunInfo | None,
        rank: int,
        world_size: int,
        *,
        write: bool,
    ) -> None:
        self.info = info
        self.rank = rank
        self.world_size = world_size
        self.write = write and info is not None
        self.host = socket.gethostname()
        # Monotonic and wall clock taken together: durations are monotonic, records carry wall times.
        self.t0 = _clock()
        self.wall0_ns = time.time_ns()
        start_ns = info.process_start_ns if info is not None else self.wall0_ns
        self.start_ns = min(start_ns, self.wall0_ns)
        self.seconds: dict[str, float] = defaultdict(float)
        self.productive = 0.0  # kept apart from `seconds`: added to on every step (an attribute, not a dict entry)
        self.redone = 0.0
        self.prev_end: float | None = None  # end of the last step (monotonic)
        self.fwd: float | None = None  # first forward since then
        self.bwd: float | None = None  # first backward since then
        self.excluded = 0.0  # section time since the last step end (not step time)
        self.steps = 0  # steps completed in this process
        self.global_step = 0  # the run's step number (set from the checkpoint at a resume)
        self.redo_until = -1  # steps below this number were computed by an earlier attempt already
        self.step_as: str | None = None  # the category the step that is ending counts as (count_step_as)
        self.resumed_from: int | None = None
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)  # filled as each chunk is handed to the monitor thread
        self.every = chunk_steps(world_size)
        self.chunk: list[tuple[float, float, float]] = []
        self.saves: list[tuple[float, int]] = []  # (seconds blocked, step) of every save
        self.first_step_ns: int | None = None
        #: filled on global rank 0 by the straggler analysis: seconds each rank waited, and who was named
        self.waiting_by_rank: dict[int, float] = defaultdict(float)
        self.stragglers: list[dict[str, Any]] = []
        self.ended = False
        self.at_end: Callable[[Ledger], None] | None = None
        self._lock = threading.Lock()  # one writer of the record at a time (the monitor thread, exit)

    # -------------------------------------------------------------------------------------------- record
    def wall_ns(self, monotonic: float) -> int:
        return self.wall0_ns + int((monotonic - self.t0) * 1e9)

    def snapshot(self) -> dict[str, Any]:
        """This rank's record (what :meth:`flush` writes)."""
        info = self.info
        return {
            "version": 1,
            "run_id": info.id if info else None,
            "attempt": info.attempt if info else 0,
            "job": info.job if info else None,
            "restart": info.restart if info else 0,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": os.getpid(),
            "process_start_ns": self.start_ns,
            "first_step_ns": self.first_step_ns,
            "last_step_ns": self.wall_ns(self.prev_end) if self.prev_end is not None else None,
            "updated_ns": time.time_ns(),
            "ended": self.ended,
            "seconds": {**self.seconds, "productive": self.productive, "redone": self.redone},
            "steps": self.steps,
            "global_step": self.global_step,
            "resumed_from": self.resumed_from,
            "redo_until": self.redo_until,
            "step_time_median": median([*self.recent, *(mark[2] for mark in self.chunk)]),
            "saves": [{"seconds": s, "step": step} for s, step in self.saves],
            "waiting_by_rank": {str(r): s for r, s in self.waiting_by_rank.items()},
            "stragglers": list(self.stragglers),
        }

    def path(self) -> Path | None:
        if not self.write or self.info is None:
            return None
        return self.info.path(FOLDER, f"attempt-{self.info.attempt:03d}", f"rank-{self.rank:05d}.json")

    def flush(self) -> None:
        """Write this rank's record now (atomic replace); never raises (the run must not fail for its ledger)."""
        path = self.path()
        if path is None:
            return
        with self._lock:
            try:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(self.snapshot()))
                os.replace(tmp, path)
            except (OSError, TypeError, ValueError):  # a full or read-only disk, a value JSON cannot hold
                pass

    # -------------------------------------------------------------------------------------------- resume
    def saves_path(self) -> Path | None:
        if not self.write or self.info is None:
            return None
        return self.info.path(FOLDER, f"attempt-{self.info.attempt:03d}", "saves.jsonl")

    def record_save(self, location: str, seconds: float) -> None:
        self.saves.append((seconds, self.global_step))
        path = self.saves_path() if self.rank == 0 else None
        if path is None:
            return
        try:
            with open(path, "a") as f:
                f.write(json.dumps({"path": location, "step": self.global_step, "time_ns": time.time_ns()}) + "\n")
        except OSError:
            pass

    def resume(self, location: str) -> None:
        """A checkpoint was loaded: continue the step count from its step, and count steps up to the highest an
        earlier attempt reached as redone."""
        if self.info is None or not self.write:
            return
        folder = self.info.dir / FOLDER
        step = None
        highest = -1
        try:
            attempts = sorted(p for p in folder.iterdir() if p.name.startswith("attempt-"))
        except OSError:
            return
        for attempt in attempts:
            if attempt.name == f"attempt-{self.info.attempt:03d}":
                continue
            try:
                for line in (attempt / "saves.jsonl").read_text().splitlines():
                    entry = json.loads(line)
                    if entry.get("path") == location:
                        step = int(entry["step"])
            except (OSError, ValueError, KeyError):
                pass
            for record in attempt.glob("rank-*.json"):
                try:
                    highest = max(highest, int(json.loads(record.read_text())["global_step"]))
                except (OSError, ValueError, KeyError):
                    pass
        if step is None:
            return  # a checkpoint of another run (fine-tuning from it): nothing is redone
        self.global_step = step
        self.resumed_from = step
        self.redo_until = highest


def median(values: Any) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# ------------------------------------------------------------------------------------------------ the hot path
def on_forward() -> None:
    """A forward of a set-up module began (the first one after a step is a straggler mark); progress."""
    global beats
    beats += 1
    ledger = _ledger
    if ledger is not None and ledger.fwd is None:
        ledger.fwd = _clock()


def on_backward() -> None:
    """``fabric.backward`` began (the first one after a step is a straggler mark); progress."""
    global beats
    beats += 1
    ledger = _ledger
    if ledger is not None and ledger.bwd is None:
        ledger.bwd = _clock()


def on_step() -> None:
    """``optimizer.step()`` of a set-up optimizer returned: the step is over; progress."""
    global beats
    beats += 1
    if events:
        _deliver()
    ledger = _ledger
    if ledger is None:
        return
    now = _clock()
    previous = ledger.prev_end
    ledger.prev_end = now
    step = ledger.global_step
    ledger.global_step = step + 1
    ledger.steps += 1
    if previous is None:  # this process's first step: start-up ends here
        ledger.seconds["startup"] += now - ledger.t0 + (ledger.wall0_ns - ledger.start_ns) / 1e9 - ledger.excluded
        ledger.first_step_ns = ledger.wall_ns(now)
        ledger.step_as = None  # the first step is start-up whatever it did
    else:
        took = now - previous - ledger.excluded
        if ledger.step_as is not None:
            ledger.seconds[ledger.step_as] += took
            ledger.step_as = None
        elif step < ledger.redo_until:
            ledger.redone += took
        else:
            ledger.productive += took
        forward, backward = ledger.fwd, ledger.bwd
        chunk = ledger.chunk
        chunk.append(((forward or now) - previous, (backward or now) - previous, took))
        if (step + 1) % ledger.every == 0:
            ledger.recent.extend(mark[2] for mark in chunk)  # here, not in the monitor: a record written next has them
            if ready.qsize() < 1024:  # (a monitor thread that stopped must not make it grow without end)
                ready.put((ledger, step // ledger.every, chunk))  # wakes the monitor thread, which publishes it
            ledger.chunk = []
    ledger.fwd = ledger.bwd = None
    ledger.excluded = 0.0
    if _injector is not None:  # fabric chaos (runtime/chaos.py): faults scheduled at this step
        _injector.at_step(step)


def count_step_as(category: str) -> None:
    """The training step that is ending (before ``optimizer.step()`` returns) counts as ``category``, not as a
    productive step: fabric-ft calls it with ``"quorum"`` for a step that the quorum dropped or that changed the
    quorum. No effect without a ledger."""
    if not isinstance(category, str) or not category or category in ("startup", "productive", "waiting", "restart", "other"):
        raise ValueError(f"`count_step_as` takes a category such as 'quorum', got {category!r}.")
    ledger = _ledger
    if ledger is not None:
        ledger.step_as = category


def post_event(event: Any) -> None:
    """From the monitor thread: give ``event`` to the main thread's handler at its next step."""
    events.append(event)


def set_event_handler(handler: Callable[[Any], None] | None) -> None:
    """Who receives the posted events on the main thread (``Fabric``: loggers and ``on_straggler`` callbacks)."""
    global _event_handler
    _event_handler = handler


def _deliver() -> None:
    while events:
        event = events.popleft()
        if _event_handler is not None:
            _event_handler(event)


# ------------------------------------------------------------------------------------------------ sections
@contextmanager
def section(name: str, hang_limit: float | None = None) -> Generator[None, None, None]:
    """Attribute the time inside to ``name`` instead of the step it interrupts, and let the hang detector use
    ``hang_limit`` seconds (or its default for ``name``) while the main thread is inside.

    Nested sections count as the outermost one. Works without a ledger too (then only the limit applies).
    """
    if not isinstance(name, str) or not name or name in ("startup", "productive", "waiting", "restart", "redone", "other"):
        raise ValueError(
            f"A section's name must be a non-empty string other than the ledger's own categories, got {name!r}"
            " (e.g. 'evaluation', 'rank_zero', 'data')."
        )
    if hang_limit is not None and not (isinstance(hang_limit, (int, float)) and hang_limit > 0):
        raise ValueError(f"`hang_limit` must be a positive number of seconds or None, got {hang_limit!r}.")
    global beats
    started = _clock()
    beats += 1  # entering or leaving a section is progress
    _sections.append((name, started, None if hang_limit is None else float(hang_limit)))
    try:
        yield
    finally:
        _sections.pop()
        now = _clock()
        beats += 1
        ledger = _ledger
        if ledger is not None and not _sections:
            took = now - started
            ledger.seconds[name] += took
            ledger.excluded += took


#: The name under which :mod:`fabric_core.utilities` hands :func:`section` to plugins (the plugin SDK).
goodput_section = section


def current_section() -> tuple[str, float, float | None] | None:
    """The outermost section the main thread is in (``(name, started, hang_limit)``), or ``None``."""
    sections = _sections
    return sections[0] if sections else None


def in_first_step() -> bool:
    """Whether this process has not completed a step yet (the hang detector's start-up limit applies)."""
    ledger = _ledger
    return ledger is None or ledger.prev_end is None


def recent_step_time() -> float | None:
    """The median of the recent steps' times (``None`` before two steps)."""
    ledger = _ledger
    return median(list(ledger.recent)) if ledger is not None else None


# ------------------------------------------------------------------------------------------------ lifecycle
def start(
    info: RunInfo | None,
    rank: int,
    world_size: int,
    *,
    write: bool,
    injector: Any = None,
    at_end: Callable[[Ledger], None] | None = None,
) -> Ledger:
    """Keep this process's ledger from now on (once per process; a second call updates who it is).

    ``injector``: fabric chaos's faults for this rank (:mod:`fabric_core.runtime.chaos`), fired at step ends;
    ``at_end``: what global rank 0 does with the ledger when its process ends (the report's summary)."""
    global _ledger, marking, _injector
    ledger = _ledger
    if ledger is None or ledger.info != info:
        ledger = Ledger(info, rank, world_size, write=write)
        _ledger = ledger
        atexit.register(_at_exit, ledger)
    else:
        ledger.rank, ledger.world_size, ledger.write = rank, world_size, write and info is not None
    marking = True
    _injector = injector
    ledger.at_end = at_end
    return ledger


def current() -> Ledger | None:
    return _ledger


def stop() -> None:
    """No more ledger in this process (tests, a process that starts another run)."""
    global _ledger, marking
    _ledger = None
    marking = watched


def _at_exit(ledger: Ledger) -> None:
    if _ledger is not ledger:
        return
    ledger.ended = True
    ledger.flush()
    if ledger.rank == 0 and ledger.write and ledger.info is not None and ledger.at_end is not None:
        ledger.at_end(ledger)


__all__ = [
    "CATEGORIES",
    "CHECKPOINT",
    "EVALUATION",
    "QUORUM",
    "Ledger",
    "count_step_as",
    "current",
    "current_section",
    "goodput_section",
    "in_first_step",
    "on_backward",
    "on_forward",
    "on_step",
    "post_event",
    "recent_step_time",
    "section",
    "set_event_handler",
    "start",
    "stop",
]
