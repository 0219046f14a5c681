"""Hang detection, on by default in every multi-process run: a rank that makes no progress is named with its line and
every rank's stack; the job ends only at a longer bound.

Without it, a rank stuck in user code holds every other rank in their next collective until the collective timeout
(30 minutes by default), and the error then names neither the rank nor the line.

**Progress** is a call of Fabric's training loop: a forward of a set-up module, ``fabric.backward``,
``optimizer.step()`` of a set-up optimizer (they report inline, through :mod:`fabric_core.runtime.goodput`'s marks),
the facade's methods marked :func:`counts_as_progress` (the collectives, ``fabric.save``/``load``, ``fabric.setup*``),
and :func:`report_progress` for code that legitimately runs long without them.

**Limits** (``FABRIC_HANG_TIMEOUT`` unset: the default), chosen from the run's own step time and from what the main
thread is doing (:func:`current_limits`); a rank is *named* at the first and the job *ended* at twice it:

* training steps: ``max(60 s, 20 x the median of the recent steps)``;
* start-up, before this process's first optimizer step (imports, compilation, the first step): 15 minutes;
* a checkpoint (inside ``fabric.save``/``load``): 15 minutes, or the step limit if longer;
* a section the script declares, ``with fabric.section("evaluation"):`` (rank-0-only work, an evaluation): its
  ``hang_limit``, else 60 minutes.

``FABRIC_HANG_TIMEOUT=S`` overrides: every rank (also a single process) is named and ended at ``S`` seconds of no
progress, except inside sections with their own ``hang_limit``; ``0`` or ``off`` switches detection off. A single
process is not watched by default (no other rank waits for it).

**Who is named.** A daemon thread in every rank (the monitor) checks the time since the last progress:

* a rank whose main thread is in the user's code (``time.sleep``, a Python loop, I/O) past its limit is what the
  others wait for: it prints its rank, the line it is at and the stack of every thread, and tells the other ranks,
  which print their own stacks (through the job's store, :mod:`fabric_core.runtime.peers`). At the end bound it
  records the same as its error (so the launcher's last lines quote it) and exits with code 124 (as ``timeout(1)``);
  the launcher then ends the job;
* a rank whose main thread is inside library code (torch, Fabric and its plugins, the frameworks they drive, the
  standard library: a collective, a backward, an import) is usually waiting for another rank and is never named on
  its own evidence: global rank 0 reads every rank's heartbeat and names a rank whose heartbeat stopped (a process
  stopped with SIGSTOP, frozen, or gone) or, when every rank waits in a collective, the ranks that wait somewhere
  else than the others. A long section on one rank (a 3-minute evaluation on rank 0) names nobody: the ranks waiting
  for it are in a collective, and rank 0 is within its section's limit. Without a store to talk through, a waiting
  rank falls back to twice the limits;
* if the thread itself cannot run (native code holding the GIL), ``faulthandler.dump_traceback_later`` fires at three
  end bounds: it prints every thread's stack and exits with code 1.

Which packages are library code beyond torch, the core and the standard library, each installed plugin says for its
own (the ``fabric_library_packages`` hook, asked by ``Fabric`` when the watchdog starts). The same thread writes the
goodput ledger's record and publishes the straggler marks (:mod:`fabric_core.runtime.stragglers`).
"""

from __future__ import annotations

import atexit
import faulthandler
import linecache
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from functools import wraps
from types import FrameType
from typing import Any, NamedTuple, TypeVar

from fabric_core.runtime import failures, goodput, stragglers
from fabric_core.runtime.peers import Peers

HANG_TIMEOUT_VARIABLE = "FABRIC_HANG_TIMEOUT"
#: The exit code of a rank ended for making no progress (``timeout(1)``'s).
HANG_EXIT_CODE = 124
#: What a plugin may say about a package's frames (``fabric_library_packages``): library code, or library code
#: where a rank whose innermost frame is there waits for the other ranks (a collective).
LIBRARY, COLLECTIVE = "library", "collective"
#: Folders whose frames mean "waiting for the other ranks" when they are innermost (torch's; plugins add theirs).
_WAITING_IN: set[str] = {"torch/distributed/", "torch/autograd/", "torch/nn/parallel/"}
#: Top-level packages whose frames are library code, skipped when naming the user's line (plugins add theirs).
_LIBRARIES: set[str] = {"fabric_core", "torch"}

# The default limits (docs/decisions.md, "Hangs named by default").
STEP_FLOOR_S = 60.0
STEP_FACTOR = 20.0
STARTUP_S = 15 * 60.0
CHECKPOINT_S = 15 * 60.0
SECTION_S = 60 * 60.0
#: The job is ended at this many times the limit at which the rank was named (default limits only).
END_FACTOR = 2.0
#: Seconds between a rank's heartbeats, and between rank 0's readings of them (up to 1,024 ranks; above, this
#: times N/1,024, so the store sees at most ~512 heartbeats per second: docs/scaling.md).
HEARTBEAT_S = 2.0
#: Seconds between writes of the goodput ledger's record.
FLUSH_S = 2.0
#: A rank whose heartbeat is this old (at least; and at least 3 heartbeat intervals) is not running.
STALE_S = 15.0


def heartbeat_interval(world_size: int) -> float:
    return HEARTBEAT_S * max(1.0, world_size / 1024)
#: A rank this idle starts to look at what the other ranks say (and describes where it is in its heartbeat).
IDLE_S = 5.0

# The standard library's folder, as ``sysconfig.get_paths()["stdlib"]`` says, without importing ``sysconfig`` (about
# 2 ms at every `import fabric_core`): the folder ``os`` was loaded from.
_STDLIB = os.path.dirname(os.__file__)

_clock = time.monotonic
_last = _clock()
_watchdog: _Watchdog | None = None
#: Whether a watchdog watches this process now (public, read-only elsewhere).
watching = False
_on_hang: list[Callable[[failures.RecordedError], None]] = []


class HangError(RuntimeError):
    """The name under which a rank's lack of progress is recorded and reported."""


def report_progress() -> None:
    """Tell the hang detector that this rank is making progress (Fabric's training calls do it themselves)."""
    global _last
    _last = _clock()


def _setting() -> str:
    return os.environ.get(HANG_TIMEOUT_VARIABLE, "").strip()


def hang_timeout() -> float | None:
    """``FABRIC_HANG_TIMEOUT`` in seconds when it sets a fixed limit, else ``None`` (unset: the default limits;
    ``0``/``off``: no detection)."""
    value = _setting()
    if not value or value.lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"`{HANG_TIMEOUT_VARIABLE}={value}` must be a number of seconds (unset: limits from the run's step time;"
            " 0 or off: no hang detection)."
        ) from None
    if seconds < 0:
        raise ValueError(f"`{HANG_TIMEOUT_VARIABLE}={value}` must not be negative (0 or off: no hang detection).")
    return seconds or None


def detection_off() -> bool:
    """``FABRIC_HANG_TIMEOUT`` is ``0`` or ``off``."""
    value = _setting().lower()
    return value == "off" or (bool(value) and hang_timeout() is None)


def on_hang(callback: Callable[[failures.RecordedError], None]) -> None:
    """Let ``callback`` end the job when this rank hangs (a launcher whose children must be stopped first); it is
    given this rank's record and should not return. Without one, the process exits with :data:`HANG_EXIT_CODE`."""
    _on_hang.append(callback)


F = TypeVar("F", bound=Callable[..., Any])


def counts_as_progress(method: F) -> F:
    """Mark a call of the training loop as progress, before and after it runs (a collective, a save, a setup).

    For calls that take long next to the extra frame; the per-step ones (forward, ``backward``,
    ``optimizer.step()``) report through the goodput marks."""

    @wraps(method)
    def reporting(*args: Any, **kwargs: Any) -> Any:
        report_progress()
        result = method(*args, **kwargs)
        report_progress()
        return result

    return reporting  # type: ignore[return-value]


def add_library_packages(packages: Mapping[str, str]) -> None:
    """Read the frames of ``packages`` (``{"deepspeed": "library", "deepspeed.comm": "collective"}``) as library code
    in the hang report; a ``"collective"`` (sub)package is also where a rank waits for the others."""
    for package, role in packages.items():
        if role not in (LIBRARY, COLLECTIVE) or not isinstance(package, str) or not package:
            raise ValueError(
                f"`fabric_library_packages` answered {package!r}: {role!r}; map an import package's name to"
                f" {LIBRARY!r} or {COLLECTIVE!r}."
            )
        _LIBRARIES.add(package.split(".", 1)[0])
        if role == COLLECTIVE:
            _WAITING_IN.add(package.replace(".", "/") + "/")


# ------------------------------------------------------------------------------------------------ limits
class Limits(NamedTuple):
    """When a rank without progress is named, when the job is ended, and why those numbers."""

    name: float
    end: float
    why: str


def current_limits(fixed: float | None = None) -> Limits:
    """The limits for what the main thread is doing now (see the module's docstring)."""
    section = goodput.current_section()
    if section is not None and section[2] is not None:
        limit = section[2]
        return Limits(limit, limit if fixed is not None else END_FACTOR * limit, f"section {section[0]!r}, its hang_limit")
    if fixed is not None:
        return Limits(fixed, fixed, f"{HANG_TIMEOUT_VARIABLE}={fixed:g}")
    step = goodput.recent_step_time()
    step_limit = max(STEP_FLOOR_S, STEP_FACTOR * step) if step else STEP_FLOOR_S
    if section is not None:
        base = CHECKPOINT_S if section[0] == goodput.CHECKPOINT else SECTION_S
        limit = max(base, step_limit)
        return Limits(limit, END_FACTOR * limit, f"section {section[0]!r}")
    if goodput.in_first_step():
        return Limits(STARTUP_S, END_FACTOR * STARTUP_S, "start-up, before the first step")
    why = f"training steps: max({STEP_FLOOR_S:g} s, {STEP_FACTOR:g} x median step {step:.3g} s)" if step else "training steps"
    return Limits(step_limit, END_FACTOR * step_limit, why)


# ------------------------------------------------------------------------------------------------ lifecycle
def start_watchdog(
    rank: int,
    library_packages: Callable[[], Mapping[str, str]] | None = None,
    *,
    world_size: int = 1,
    job: str | None = None,
    restart: int = 0,
) -> None:
    """Start this process's monitor thread for ``rank`` (once per process): hang detection when it is on (by
    default for ``world_size`` > 1; ``FABRIC_HANG_TIMEOUT`` decides), the goodput ledger's writes, the straggler marks.

    ``library_packages`` is asked then (only then) for the installed plugins' packages (:func:`add_library_packages`).
    ``job``/``restart`` name the store keys of this attempt (:mod:`fabric_core.runtime.peers`).
    """
    global _watchdog, watching
    fixed = hang_timeout()
    detect = not detection_off() and (fixed is not None or world_size > 1)
    if not detect and goodput.current() is None and world_size < 2:
        return  # nothing to watch, write or publish
    if detect and library_packages is not None:
        add_library_packages(library_packages())
    report_progress()
    watching = goodput.watched = detect
    if detect:
        goodput.marking = True
    if _watchdog is not None and _watchdog.is_alive() and not _watchdog.stopped:
        _watchdog.update(rank, world_size, fixed, detect, job, restart)
        return
    _watchdog = _Watchdog(rank, world_size, fixed, detect, job, restart, threading.main_thread().ident)
    _watchdog.start()
    atexit.register(stop_watchdog)  # the script is done: waiting for the other ranks at exit is not a hang


#: Put on the monitor thread's queue to wake it (an owner no ledger is: never taken for a chunk of step marks).
_WAKE = (object(), -1, [])


def stop_watchdog() -> None:
    """The job is ending (a launcher is stopping the ranks, or the script is done): no more hang reports."""
    global watching
    watching = goodput.watched = False
    watchdog = _watchdog
    if watchdog is not None:
        watchdog.stopped = True
        faulthandler.cancel_dump_traceback_later()
        goodput.ready.put(_WAKE)  # at once, not at its next interval: a script's exit is not kept waiting
        if watchdog.is_alive() and watchdog is not threading.current_thread():
            watchdog.join(timeout=2.0)  # its store client must be gone before the process group is destroyed


#: Files whose frames on the main thread's stack mean "compiling" (a recompilation after the first step can take
#: minutes; it is not a hang); running a compiled graph is not in them.
_WORKING_IN = ("torch/_dynamo/convert_frame.py", "torch/_dynamo/symbolic_convert.py", "torch/_inductor/compile_fx.py")


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread is importing or compiling (work, however long it takes), and not waiting for the
    other ranks in a collective (its innermost frame)."""
    if frame is not None and any(marker in frame.f_code.co_filename.replace(os.sep, "/") for marker in _WAITING_IN):
        return False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen importlib") or any(marker in filename.replace(os.sep, "/") for marker in _WORKING_IN):
            return True
        frame = frame.f_back
    return False


def _is_library(filename: str) -> bool:
    parts = filename.replace(os.sep, "/").split("/")
    if filename.startswith(("<", _STDLIB)) or "site-packages" in parts:
        return True
    return any(part in _LIBRARIES for part in parts[:-1])


class Where(NamedTuple):
    """Where a main thread is: for the report and for the heartbeat."""

    stack: str  # the formatted stack, most recent call last
    in_library: bool  # its innermost frame is library code
    collective: bool  # ... in a package where ranks wait for each other
    short: str  # "wait() (torch/distributed/...:123), called at train.py:45 in step(): fabric.barrier()"
    user: str  # the user's line ("train.py:45 in step(): ...") or ""


def where(frame: FrameType | None) -> Where:
    stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
    text = "".join(stack.format())
    if not stack:
        return Where(text, False, False, "", "")
    innermost = stack[-1]
    in_library = _is_library(innermost.filename)
    collective = any(marker in innermost.filename.replace(os.sep, "/") for marker in _WAITING_IN)
    user = next((f for f in reversed(stack) if not _is_library(f.filename)), None)
    at = ""
    if user is not None:
        line = (user.line or linecache.getline(user.filename, user.lineno or 0)).strip()
        at = f"{user.filename}:{user.lineno} in {user.name}(): {line}"
    called = f", called at {at}" if at else ""
    return Where(text, in_library, collective, f"{innermost.name}() ({innermost.filename}:{innermost.lineno}){called}", at)


def describe_stack(
    frame: FrameType | None, rank: int, idle: float, limit: float, why: str | None = None
) -> tuple[str, str, bool]:
    """``(message, stack, in_library)`` for the main thread at ``frame``: where it is, and whether its innermost frame
    is library code (a collective, a backward, an import: often waiting for another rank)."""
    found = where(frame)
    head = f"Rank {rank} made no progress for {idle:.1f} s (limit {limit:g} s: {why or f'{HANG_TIMEOUT_VARIABLE}={limit:g}'})"
    if not found.short:
        return f"{head}; its main thread has no Python frame.", found.stack, False
    if found.collective:
        message = f"{head}: it is waiting in {found.short}. Another rank has probably stopped before this call."
    elif found.in_library:
        message = f"{head}: it is inside {found.short}"
    else:
        message = f"{head}: it is running {found.user or found.short}"
    return message, found.stack, found.in_library


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed or broken stderr, or none
        pass


def _dump_stacks(rank: int, why: str) -> None:
    _write(f"[fabric] {why}\n[fabric] Stacks of rank {rank}'s threads:\n")
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError, AttributeError):  # no usable stderr (closed, none, no fileno)
        pass


class _Watchdog(threading.Thread):
    def __init__(
        self, rank: int, world_size: int, fixed: float | None, detect: bool, job: str | None, restart: int, main_ident: int | None
    ) -> None:
        super().__init__(name="fabric-monitor", daemon=True)
        self.main_ident = main_ident
        self.stopped = False
        self.peers: Any = None
        self.update(rank, world_size, fixed, detect, job, restart)

    def update(self, rank: int, world_size: int, fixed: float | None, detect: bool, job: str | None, restart: int) -> None:
        self.rank, self.world_size, self.fixed, self.detect = rank, world_size, fixed, detect
        self.job, self.restart = job, restart
        self.interval = min(0.5, fixed / 10) if fixed else 0.5
        self.beat_every = heartbeat_interval(world_size)
        self.named_at: float | None = None  # how long it had made no progress when it named itself (this stall)
        self.own_flag: str | None = None  # the hang flag it published about itself
        self.seen_flag: int | None = None  # the last hang flag this rank printed its stack for
        self.flag: dict[str, Any] | None = None
        self.next_beat = self.next_flush = self.next_read = 0.0
        self.verdict_id = 0
        self.flagged: tuple[int, ...] = ()
        self.reconnect = True
        self.watch = stragglers.StragglerWatch()
        self.pending_chunks: dict[int, float] = {}
        self.seen_beats = -1
        self.named_stragglers: list[dict[str, Any]] = []

    # -------------------------------------------------------------------------------------------- the loop
    def run(self) -> None:
        while not self.stopped:
            limits = current_limits(self.fixed)
            if self.detect:
                # Backstop for a main thread that holds the GIL in native code: then this thread cannot re-arm it.
                faulthandler.dump_traceback_later(3 * limits.end, exit=True)
            chunks = []
            try:
                chunks.append(goodput.ready.get(timeout=self.interval))  # a chunk of step marks wakes it at once
                while True:
                    chunks.append(goodput.ready.get_nowait())
            except queue.Empty:
                pass
            if self.stopped:
                break
            try:
                self.tick(limits, chunks)
            except Exception as err:  # the monitor must never take the run down by itself
                _write(f"[fabric] the monitor thread of rank {self.rank} failed and stops: {type(err).__name__}: {err}\n")
                break
        faulthandler.cancel_dump_traceback_later()
        self.peers = None

    def tick(self, limits: Limits, chunks: list[tuple[Any, int, list[tuple[float, float, float]]]]) -> None:
        now = _clock()
        if goodput.beats != self.seen_beats:  # the per-step calls count instead of reading the clock
            self.seen_beats = goodput.beats
            report_progress()
        ledger = goodput.current()
        chunks = [(index, marks) for owner, index, marks in chunks if owner is ledger]  # (their times are in ledger.recent)
        if self.peers is None and self.reconnect and self.world_size > 1 and self.job is not None:
            self.reconnect = False
            self.peers = Peers.connect(self.job, self.restart, self.rank, self.world_size)
        peers = self.peers if self.peers is not None and not self.peers.failed else None
        if ledger is not None:
            if peers is not None:
                published = bool(chunks)
                for index, marks in chunks:
                    peers.append_chunk(index, {"rank": self.rank, "host": ledger.host, "step": index * ledger.every, "marks": marks})
                    if self.rank == 0:
                        self.pending_chunks[index] = now
                if self.rank == 0:
                    self.read_chunks(peers, ledger, now, wait=0.3 if published else 0.0)
                elif published:
                    self.read_stragglers(peers)  # once per chunk: who rank 0 named
            if now >= self.next_flush:
                self.next_flush = now + FLUSH_S
                ledger.flush()
        idle = now - _last
        frame = None
        quiet = min(IDLE_S, 0.5 * limits.name)  # from here on a rank describes where it is and asks the others
        if self.detect and idle >= quiet:
            frame = sys._current_frames().get(self.main_ident) if self.main_ident is not None else None
            if _importing(frame):
                report_progress()  # a slow first import (torch._dynamo in the first setup) is work, not a hang
                return
        if peers is not None and now >= self.next_beat:
            self.next_beat = now + self.beat_every
            self.beat(peers, idle, limits, frame)
            if self.rank == 0 and self.detect:
                self.judge(peers)
            if now >= self.next_read:
                self.next_read = now + self.beat_every
                self.read_stragglers(peers)
        if not self.detect:
            return
        if idle < quiet:
            if self.named_at is not None:  # named, then moved on: it was slow, not stuck
                _write(f"[fabric] Rank {self.rank} made progress again after {self.named_at:.0f} s without.\n")
                if peers is not None and self.own_flag is not None:
                    peers.set("hang", {"id": f"{self.own_flag}-cleared", "culprits": []})
                self.named_at = self.own_flag = None
            return
        self.check(idle, limits, frame, peers)

    # -------------------------------------------------------------------------------------------- hang
    def read_flag(self, peers: Any) -> dict[str, Any] | None:
        """The hang named now (by a stuck rank, or rank 0's verdict), or one this rank sees itself: rank 0 has stopped
        beating (its monitor is the one that would judge)."""
        flag = peers.get("hang")
        if flag is not None and flag.get("culprits"):
            return flag
        if self.rank != 0:
            beat = peers.get("hb/0")
            if beat is not None:
                age = time.time() - beat["t"]
                if age > max(STALE_S, 3 * self.beat_every, 0.5 * beat.get("name", STALE_S)):
                    message = f"No heartbeat from rank 0 for {age:.0f} s: its process is stopped (SIGSTOP), frozen in native code, or gone."
                    return {"id": "rank0-stale", "culprits": [0], "message": message, "waiting_ends": True}
        return None

    def check(self, idle: float, limits: Limits, frame: FrameType | None, peers: Any) -> None:
        found = where(frame)
        flag = self.read_flag(peers) if peers is not None else None
        self.flag = flag
        if flag is not None and flag.get("id") != self.seen_flag:
            self.seen_flag = flag.get("id")
            if self.rank not in flag.get("culprits", []):
                _dump_stacks(self.rank, f"{flag.get('message')}\n[fabric] Rank {self.rank} has waited {idle:.0f} s in {found.short or 'its code'}.")
        named = flag is not None and self.rank in flag.get("culprits", [])
        own_evidence = not found.in_library or named
        if own_evidence or peers is None:
            # Without peers to ask, a rank in library code gets twice the limits (the rank it waits for goes first).
            factor = 1.0 if own_evidence else 2.0
            if idle >= factor * limits.name and self.named_at is None:
                self.named_at = idle
                message, stack, _ = describe_stack(frame, self.rank, idle, limits.name, limits.why)
                end = "" if limits.end <= limits.name else f" The job is ended if it makes none for {factor * limits.end:.0f} s."
                _dump_stacks(self.rank, message + end)
                if peers is not None and not found.in_library:
                    self.verdict_id += 1
                    self.own_flag = f"{self.rank}-{self.verdict_id}"
                    peers.set("hang", {"id": self.own_flag, "culprits": [self.rank], "message": message})
                    time.sleep(min(1.0, self.interval * 2))  # the others print their stacks before a fixed limit ends the job
            if idle >= factor * limits.end:
                message, stack, _ = describe_stack(frame, self.rank, idle, limits.name, limits.why)
                self.fire(message, stack)
            return
        # A waiting rank with peers: ended only when someone was named that cannot end the job itself (a stopped
        # rank, or every rank waiting), once this rank has waited its end bound.
        if flag is not None and flag.get("waiting_ends") and idle >= limits.end:
            self.fire(f"Rank {self.rank} waited {idle:.0f} s in {found.short}. {flag.get('message')}", found.stack)

    def beat(self, peers: Any, idle: float, limits: Limits, frame: FrameType | None) -> None:
        beat: dict[str, Any] = {"t": time.time(), "idle": idle, "name": limits.name, "end": limits.end}
        if frame is not None:
            found = where(frame)
            beat.update(library=found.in_library, collective=found.collective, where=found.short)
        section = goodput.current_section()
        if section is not None:
            beat["section"] = section[0]
        peers.heartbeat(beat)

    def judge(self, peers: Any) -> None:
        """Global rank 0: read every heartbeat and name a rank that stopped beating, or the odd ones out when every
        rank waits in a collective."""
        beats = peers.heartbeats()
        if not beats:
            return
        now = time.time()
        stale_after = lambda b: max(STALE_S, 3 * self.beat_every, 0.5 * b.get("name", STALE_S))  # noqa: E731
        culprits: list[int] = []
        message = ""
        stale = [r for r, b in enumerate(beats) if b and now - b["t"] > stale_after(b)]
        if stale:
            ages = ", ".join(f"rank {r} for {now - beats[r]['t']:.0f} s" for r in stale)
            culprits = stale
            message = (
                f"No heartbeat from {ages}: the process is stopped (SIGSTOP), frozen in native code, or gone; the other"
                " ranks wait for it."
            )
        elif all(b and b.get("collective") and b["idle"] >= b["name"] for b in beats):
            places: dict[str, list[int]] = {}
            for r, b in enumerate(beats):
                places.setdefault(str(b.get("where")), []).append(r)
            if len(places) > 1:
                odd = min(places.values(), key=len)
                culprits = odd
                listing = "; ".join(f"ranks {v} in {k}" for k, v in places.items())
                message = f"Every rank waits in a collective, not all in the same one: {listing}."
            else:
                culprits = list(range(len(beats)))
                message = f"Every rank has waited in the same collective for {min(b['idle'] for b in beats):.0f} s: {next(iter(places))}."
        if not culprits:
            # A rank stuck in library code that is not a collective (a data loader's worker, a file read) while others
            # wait in collectives: it is what they wait for.
            stuck = [r for r, b in enumerate(beats) if b and b.get("library") and not b.get("collective") and b["idle"] >= b["name"]]
            if stuck and any(b and b.get("collective") for b in beats):
                culprits = stuck
                message = "; ".join(f"rank {r} made no progress for {beats[r]['idle']:.0f} s inside {beats[r].get('where')}" for r in stuck)
                message += " (library code, not a collective); the other ranks wait for it."
        if culprits and tuple(culprits) != self.flagged:
            self.flagged = tuple(culprits)
            self.verdict_id += 1
            peers.set("hang", {"id": f"v{self.verdict_id}", "culprits": culprits, "message": message, "waiting_ends": True})
            _write(f"[fabric] Hang: {message}\n")
        elif not culprits and self.flagged:
            self.flagged = ()
            self.verdict_id += 1
            peers.set("hang", {"id": f"v{self.verdict_id}", "culprits": []})

    def fire(self, message: str, stack: str) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.stopped:
            return
        headline = f"{HangError.__name__}: {message}"
        stack = f"Stack of the main thread (most recent call last):\n{stack}{headline}\n"
        record = failures.RecordedError(headline, stack, time.time_ns())
        _write(f"[fabric] {message}\n")
        ledger = goodput.current()
        if ledger is not None:
            ledger.flush()
        failures.write_record(headline, stack)
        for callback in _on_hang:
            callback(record)
        os._exit(HANG_EXIT_CODE)

    # -------------------------------------------------------------------------------------------- stragglers
    def read_chunks(self, peers: Any, ledger: Any, now: float, wait: float = 0.0) -> None:
        """Global rank 0: analyse every chunk all ranks have published (``wait``: give the others that long to
        publish the chunk rank 0 just did; they finish the same step within milliseconds)."""
        deadline = time.monotonic() + wait
        for index in sorted(self.pending_chunks):
            entries = peers.read_chunk(index)
            while entries is None and time.monotonic() < deadline:
                time.sleep(0.02)
                entries = peers.read_chunk(index)
            if entries is None:
                if now - self.pending_chunks[index] > 60.0:  # a rank never published it (it died): forget it
                    peers.drop_chunk(index)
                    del self.pending_chunks[index]
                continue
            del self.pending_chunks[index]
            for straggler in self.watch.add(entries, named_at_step=ledger.global_step):
                _write(f"[fabric] {straggler.message()}\n")
                self.named_stragglers.append(straggler.as_dict())
                ledger.stragglers.append(straggler.as_dict())
                peers.set("stragglers", self.named_stragglers)
                stragglers.announce([straggler.as_dict()])  # rank 0's own callbacks: at its next step
            ledger.waiting_by_rank.update(self.watch.waiting)

    def read_stragglers(self, peers: Any) -> None:
        named = peers.get("stragglers")
        if named:
            stragglers.announce(named)


__all__ = [
    "COLLECTIVE",
    "HANG_EXIT_CODE",
    "HANG_TIMEOUT_VARIABLE",
    "LIBRARY",
    "HangError",
    "Limits",
    "add_library_packages",
    "counts_as_progress",
    "current_limits",
    "describe_stack",
    "hang_timeout",
    "on_hang",
    "report_progress",
    "start_watchdog",
    "stop_watchdog",
]
