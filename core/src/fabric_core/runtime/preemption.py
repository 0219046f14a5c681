"""Preemption notices: a signal that says "this job ends soon", answered by a save and an exit the scheduler requeues.

Schedulers warn before they take the machines away: Slurm sends ``--signal=USR1@90`` (or SIGTERM with ``KillWait``
before SIGKILL), Kubernetes SIGTERM and ``terminationGracePeriodSeconds`` (30 s by default) before SIGKILL, Ray's drain a
SIGTERM, torchrun's agent SIGTERM to its workers (then SIGKILL 30 s later). :class:`PreemptionNotice` turns such a
signal into a flag that the training loop reads at its next step boundary (the checkpoint tiers do: every rank agrees
on the step, saves to the fastest tier and exits with :data:`REQUEUE_EXIT_CODE`).

* **Exit status 75** (``EX_TEMPFAIL`` of ``sysexits.h``, "temporary failure, retry later"; ``FABRIC_REQUEUE_EXIT_CODE``
  to change it): Slurm requeues a job that exits with it when ``RequeueExit=75`` is set in slurm.conf (or the job
  script runs ``scontrol requeue`` on it); a Kubernetes Job's ``podFailurePolicy`` with ``onExitCodes: {operator: In,
  values: [75]}, action: Ignore`` restarts the pod without counting a failure; ``fabric run`` exits with it when its
  workers did.
* **Grace period**: the save must finish before the scheduler's SIGKILL. If the loop has not reached a step boundary
  and finished its save ``grace_period`` seconds after the signal (default ``FABRIC_PREEMPTION_GRACE``, else 30 s:
  Kubernetes's and torchrun's default), the process exits with the requeue status anyway; the checkpoints committed
  before stay valid (the commit rule).

A handler only sets a flag and starts the grace timer: nothing else is safe in a signal handler, and the training
loop's collectives must stay in step on every rank. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType

REQUEUE_EXIT_CODE_VARIABLE = "FABRIC_REQUEUE_EXIT_CODE"
GRACE_VARIABLE = "FABRIC_PREEMPTION_GRACE"
#: ``fabric run`` sets it in its workers: a worker that exits for a preemption leaves a line there, so the launcher
#: exits with the requeue status too.
MARKER_VARIABLE = "FABRIC_PREEMPTION_FILE"
REQUEUE_EXIT_CODE = 75
DEFAULT_GRACE_S = 30.0
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def requeue_exit_code() -> int:
    value = os.environ.get(REQUEUE_EXIT_CODE_VARIABLE, "").strip()
    if not value:
        return REQUEUE_EXIT_CODE
    try:
        code = int(value)
    except ValueError:
        raise ValueError(f"{REQUEUE_EXIT_CODE_VARIABLE}={value!r} must be an exit status between 1 and 255.") from None
    if not 1 <= code <= 255:
        raise ValueError(f"{REQUEUE_EXIT_CODE_VARIABLE}={value!r} must be an exit status between 1 and 255.")
    return code


def default_grace() -> float:
    value = os.environ.get(GRACE_VARIABLE, "").strip()
    return float(value) if value else DEFAULT_GRACE_S


class PreemptionNotice:
    """Catches ``signals`` in this process (main thread only); :attr:`requested` turns true when one arrives, and
    ``grace_period`` seconds later the process exits with :func:`requeue_exit_code` unless :meth:`exit` ran first."""

    def __init__(self, signals: Iterable[str | int] = DEFAULT_SIGNALS, grace_period: float | None = None) -> None:
        self.grace_period = default_grace() if grace_period is None else float(grace_period)
        if not self.grace_period > 0:
            raise ValueError(f"The preemption grace period must be a positive number of seconds, got {grace_period!r}.")
        self.exit_code = requeue_exit_code()
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals]
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._timer: threading.Timer | None = None
        self.installed = False

    def install(self) -> PreemptionNotice:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only; a loop in another thread is not told
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)
        self.installed = True
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous)  # type: ignore[arg-type]
            except (ValueError, TypeError):
                pass
        self._previous.clear()
        self.installed = False
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # a repeated notice changes nothing: the deadline stays the first one's
        self.received = signal.Signals(signum)
        self.received_at = time.monotonic()
        self._timer = threading.Timer(self.grace_period, self._deadline)
        self._timer.daemon = True
        self._timer.start()

    def _deadline(self) -> None:
        sys.stderr.write(
            f"[fabric] {self.received.name if self.received else 'A preemption notice'} arrived {self.grace_period:g} s ago"
            " and the save for it has not finished: exiting for a requeue now; the last committed checkpoint stands.\n"
        )
        sys.stderr.flush()
        leave_marker(f"deadline after {self.received.name if self.received else 'signal'}")
        os._exit(self.exit_code)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def time_left(self) -> float:
        """Seconds until the grace period ends (the full period before a notice)."""
        if self.received_at is None:
            return self.grace_period
        return self.grace_period - (time.monotonic() - self.received_at)

    def exit(self, message: str) -> None:
        """End the process for a requeue (the save is done): the marker for ``fabric run``, then ``SystemExit``."""
        if self._timer is not None:
            self._timer.cancel()
        leave_marker(message)
        sys.stderr.write(f"[fabric] {message}; exiting with status {self.exit_code} (requeue).\n")
        sys.stderr.flush()
        raise SystemExit(self.exit_code)


def leave_marker(message: str) -> None:
    path = os.environ.get(MARKER_VARIABLE)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('RANK', '0')} {message}\n")
    except OSError:
        pass
