"""``fabric run --launcher ft --ft-groups N``: a lighthouse and N replica groups on this machine, from one command.

For trying fault tolerance out, and for tests: each group is ``--devices`` processes started the way ``fabric run``
starts them (the CLI's settings, the rank and rendezvous variables torchrun gives a worker, each group with a
rendezvous port of its own), plus ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and
``FABRIC_FT_HOSTNAME=127.0.0.1``. When a process of a group fails, the group's other processes are stopped (they
would wait for it in the group's collectives, and their manager would keep the group in the lighthouse's eyes)
and the group alone is started again, up to ``--max-restarts`` times per group; the other groups go on. The job ends
when every group has ended: exit 0 when each ended with 0, else the first failure's code (its error is reported as
``fabric run`` reports a failed rank).

Options (before SCRIPT): ``--ft-groups N`` (required), ``--ft-lighthouse URL`` (use a running lighthouse instead of
starting one here), ``--ft-min-replicas`` (1), ``--ft-join-timeout-ms`` (2000), ``--ft-heartbeat-timeout-ms``
(2000): how long the lighthouse waits for the groups of the last quorum, and how long a silent group counts as
alive. The lighthouse runs inside this process (torchft's ``LighthouseServer``) and ends with it.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from fabric_core.environments import find_free_port
from fabric_core.launchers import (
    Launcher,
    RankFailure,
    ScriptRequest,
    exit_status,
    job_exit_code,
    rank_failure,
    report_failures,
    start_rank_process,
    stop_processes,
)
from fabric_ft.variables import (
    HOSTNAME_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    NUM_REPLICA_GROUPS_VARIABLE,
    REPLICA_GROUP_VARIABLE,
)

__all__ = ["ReplicaGroupsLauncher"]
OPTIONS = ("groups", "lighthouse", "min_replicas", "join_timeout_ms", "heartbeat_timeout_ms")
POLL_S = 0.1


class LaunchError(RuntimeError):
    """The job cannot start (a bad option); the message says why."""


def _int_option(request: ScriptRequest, name: str, default: int | None, least: int) -> int:
    raw = request.options.get(name)
    flag = "--ft-" + name.replace("_", "-")
    if raw is None:
        if default is None:
            raise LaunchError(f"{flag} N is required: how many replica groups to start.")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{flag} takes an integer, got {raw!r}.") from None
    if value < least:
        raise LaunchError(f"{flag} must be at least {least}, got {value}.")
    return value


class ReplicaGroupsLauncher(Launcher):
    """Starts a lighthouse and ``--ft-groups`` replica groups of a script on this machine (``fabric run --launcher
    ft``), restarting a group that loses a process."""

    runs_scripts = True

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "The `ft` launcher starts whole replica groups of a script: use `fabric run --launcher ft --ft-groups N"
            " SCRIPT`, not `fabric.launch()`."
        )

    @classmethod
    def run_script(cls, request: ScriptRequest) -> int:
        try:
            job = _Job(request)
        except LaunchError as err:
            print(f"fabric run --launcher ft: error: {err}", file=sys.stderr, flush=True)
            return 2
        return job.run()


class _Group:
    """One replica group: its processes of the current attempt."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.attempt = -1
        self.processes: list[Any] = []
        self.error_files: list[str] = []
        self.done = False
        self.failed: list[RankFailure] = []


class _Job:
    def __init__(self, request: ScriptRequest) -> None:
        unknown = sorted(set(request.options) - set(OPTIONS))
        if unknown:
            names = ", ".join("--ft-" + k.replace("_", "-") for k in unknown)
            raise LaunchError(
                f"unknown option(s) {names}; the ft launcher takes {', '.join('--ft-' + k.replace('_', '-') for k in OPTIONS)}."
            )
        if request.num_nodes != 1:
            raise LaunchError(
                "the ft launcher starts every replica group on this machine (--num-nodes 1); on several machines start"
                " one `fabric run` per group with TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and NUM_REPLICA_GROUPS set."
            )
        self.request = request
        self.groups = [_Group(g) for g in range(_int_option(request, "groups", None, 1))]
        self.min_replicas = _int_option(request, "min_replicas", 1, 1)
        self.join_timeout_ms = _int_option(request, "join_timeout_ms", 2000, 0)
        self.heartbeat_timeout_ms = _int_option(request, "heartbeat_timeout_ms", 2000, 1)
        self.lighthouse_address = request.options.get("lighthouse") or None
        self._lighthouse: Any = None
        self._errors = tempfile.mkdtemp(prefix="fabric-ft-errors-")
        self._stop = threading.Event()
        self._signal: int | None = None

    # ------------------------------------------------------------------------------------------ processes
    def _command(self) -> list[str]:
        request = self.request
        head = [sys.executable, "-m", request.script] if request.module else [sys.executable, request.script]
        return [*head, *request.script_args]

    def _start(self, group: _Group) -> None:
        group.attempt += 1
        request = self.request
        port = find_free_port()
        group.processes, group.error_files = [], []
        for local_rank in range(request.processes_per_node):
            error_file = os.path.join(
                self._errors, f"group{group.index}-attempt{group.attempt}-rank{local_rank}.json"
            )
            env = dict(os.environ)
            env.update(request.process_environment(0, local_rank, "127.0.0.1", port, restart=group.attempt))
            env.update(
                {
                    LIGHTHOUSE_VARIABLE: self.lighthouse_address or "",
                    REPLICA_GROUP_VARIABLE: str(group.index),
                    NUM_REPLICA_GROUPS_VARIABLE: str(len(self.groups)),
                    HOSTNAME_VARIABLE: "127.0.0.1",
                    # one run id per group: each group is a job of its own, restarted on its own
                    "TORCHELASTIC_RUN_ID": f"{request.run_id}-group{group.index}",
                }
            )
            group.error_files.append(error_file)
            group.processes.append(start_rank_process(self._command(), env, error_file))
        what = (
            "started"
            if group.attempt == 0
            else f"restarted (restart {group.attempt} of {request.max_restarts})"
        )
        print(
            f"[fabric-ft] replica group {group.index} {what}: {len(group.processes)} process(es)", flush=True
        )

    def _check(self, group: _Group) -> None:
        """A failed process ends its group; the group starts again while it has restarts left."""
        if group.done:
            return
        codes = [p.poll() for p in group.processes]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if not failed:
            if all(code == 0 for code in codes):
                group.done = True
            return
        stop_processes(group.processes)
        failures = [
            rank_failure(f"replica group {group.index} rank {i}", process, group.error_files[i])
            for i, process in enumerate(group.processes)
            if process.returncode not in (None, 0)
        ]
        sys.stderr.write(report_failures(failures))
        if group.attempt < self.request.max_restarts and not self._stop.is_set():
            self._start(group)
        else:
            group.done = True
            group.failed = failures
            print(
                f"[fabric-ft] replica group {group.index} failed and has no restart left; the others go on",
                flush=True,
            )

    # ------------------------------------------------------------------------------------------ the job
    def _start_lighthouse(self) -> None:
        if self.lighthouse_address:
            return
        from torchft._torchft import LighthouseServer

        port = find_free_port()
        self._lighthouse = LighthouseServer(
            bind=f"127.0.0.1:{port}",
            min_replicas=self.min_replicas,
            join_timeout_ms=self.join_timeout_ms,
            heartbeat_timeout_ms=self.heartbeat_timeout_ms,
        )
        self.lighthouse_address = f"http://127.0.0.1:{port}"
        print(
            f"[fabric-ft] lighthouse at {self.lighthouse_address} (status: {self.lighthouse_address}/status)",
            flush=True,
        )

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum
        self._stop.set()

    def run(self) -> int:
        # Every group needs a rendezvous port of its own (and the lighthouse one more): a fixed STANDALONE_PORT, which
        # `find_free_port` would hand out each time, cannot serve them.
        os.environ.pop("STANDALONE_PORT", None)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_lighthouse()
            for group in self.groups:
                self._start(group)
            while not self._stop.is_set() and not all(g.done for g in self.groups):
                for group in self.groups:
                    self._check(group)
                time.sleep(POLL_S)
        finally:
            stop_processes([p for g in self.groups for p in g.processes])
            if self._lighthouse is not None:
                self._lighthouse.shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)
            _remove_tree(self._errors)
        if self._signal is not None:
            return exit_status(-self._signal)
        failures = [f for g in self.groups for f in g.failed]
        return job_exit_code(failures) if failures else 0


def _remove_tree(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
