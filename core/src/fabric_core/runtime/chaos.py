"""Faults injected into a training run from inside its ranks, on a schedule ``fabric chaos`` hands over in
``FABRIC_CHAOS`` (:mod:`fabric_core.testing.chaos` makes and checks the schedule).

Each fault fires on the ranks it names when they complete a given step (``optimizer.step()`` returns), once per run:
before firing, each rank writes a marker ``chaos/fired-<fault>-rank-<rank>`` into the run folder, so the attempt that
resumes after it (and passes the same step again) does not fire it again. The kinds:

* ``kill``: ``SIGKILL`` of the rank itself (a node's ranks: ``"node": N`` instead of ``"ranks"``);
* ``hang``: the rank sleeps forever in a frame that reads as user code (the hang detector names it as it would a
  user's stuck line);
* ``slow``: the rank sleeps ``seconds`` more in each of ``steps`` steps (a straggler);
* ``stop``: ``SIGSTOP`` of the rank itself, and a helper process that sends ``SIGCONT`` after ``seconds``;
* ``disk_full``: the next checkpoint write of the rank fails with ``ENOSPC`` half way through the file (the
  single-file writer's real error path: the partial file goes, the previous checkpoint stays).

Nothing here runs unless ``FABRIC_CHAOS`` is set; the per-step check is one global read.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CHAOS_VARIABLE = "FABRIC_CHAOS"
KINDS = ("kill", "hang", "slow", "stop", "disk_full")


@dataclass
class Fault:
    """One scheduled fault (``FABRIC_CHAOS`` holds ``{"faults": [...]}`` of these as dicts)."""

    kind: str
    step: int
    ranks: list[int] = field(default_factory=list)
    node: int | None = None
    seconds: float = 0.0  # slow: extra seconds per step; stop: how long the rank stays stopped
    steps: int = 1  # slow: for how many steps

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Unknown fault kind {self.kind!r}; choose from {', '.join(KINDS)}.")
        if self.step < 0 or self.steps < 1 or self.seconds < 0:
            raise ValueError(f"A fault needs step >= 0, steps >= 1 and seconds >= 0, got {self}.")
        if not self.ranks and self.node is None:
            raise ValueError(f"A fault names its ranks (`ranks`) or a node (`node`), got {self}.")

    def hits(self, rank: int, node_rank: int) -> bool:
        return rank in self.ranks or (self.node is not None and node_rank == self.node)


def parse(text: str) -> list[Fault]:
    """The faults of a ``FABRIC_CHAOS`` value (JSON: ``{"faults": [{"kind": ..., "step": ..., ...}, ...]}``)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"`{CHAOS_VARIABLE}` must be JSON ({{\"faults\": [...]}}): {err}") from None
    entries = data.get("faults") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"`{CHAOS_VARIABLE}` must be an object with a list `faults`, got {text[:200]!r}.")
    return [Fault(**entry) for entry in entries]


class Injector:
    """The faults this rank takes part in, fired from the ledger's step end (:func:`fabric_core.runtime.goodput.on_step`)."""

    def __init__(self, faults: list[Fault], rank: int, node_rank: int, folder: Path | None) -> None:
        self.rank = rank
        self.folder = folder
        self.faults = [(i, f) for i, f in enumerate(faults) if f.hits(rank, node_rank)]
        self.slow: list[Fault] = []

    def marker(self, index: int) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / "chaos" / f"fired-{index}-rank-{self.rank}"

    def fired(self, index: int) -> bool:
        marker = self.marker(index)
        return marker is not None and marker.exists()

    def mark(self, index: int, kind: str) -> None:
        marker = self.marker(index)
        if marker is None:
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"kind": kind, "time_ns": time.time_ns(), "pid": os.getpid()}))

    def at_step(self, step: int) -> None:
        """Called when this rank's step ``step`` (the run's count, from 0) has completed."""
        for index, fault in self.faults:
            if fault.kind == "slow":
                if fault.step <= step < fault.step + fault.steps:
                    time.sleep(fault.seconds)
                continue
            if fault.step != step or self.fired(index):
                continue
            self.mark(index, fault.kind)
            _write(f"[fabric chaos] rank {self.rank}: {fault.kind} at step {step}\n")
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                _hang_forever()
            elif fault.kind == "stop":
                subprocess.Popen(  # noqa: S603 (our own command)
                    ["/bin/sh", "-c", f"sleep {fault.seconds:g}; kill -CONT {os.getpid()}"],
                    stdin=subprocess.DEVNULL,
                )
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "disk_full":
                from fabric_core.io import commit

                commit.fail_next_write = OSError(errno.ENOSPC, "No space left on device (injected by fabric chaos)")


# The injected hang runs in a frame of its own "file", so the hang detector reads it as the user's code.
_HANG = compile("while True:\n    time.sleep(3600)  # fabric chaos: an injected hang\n", "fabric_chaos_injected_hang.py", "exec")


def _hang_forever() -> None:
    exec(_HANG, {"time": time})  # noqa: S102 (our own constant code)


def _write(text: str) -> None:
    import sys

    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed or broken stderr, or none
        pass


def injector_from_environment(rank: int, node_rank: int, folder: Path | None) -> Injector | None:
    """The injector for this rank when ``FABRIC_CHAOS`` holds a schedule that names it, else ``None``."""
    text = os.environ.get(CHAOS_VARIABLE, "").strip()
    if not text:
        return None
    injector = Injector(parse(text), rank, node_rank, folder)
    return injector if injector.faults else None


__all__ = ["CHAOS_VARIABLE", "KINDS", "Fault", "Injector", "injector_from_environment", "parse"]
