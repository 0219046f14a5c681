"""The default launcher of ``strategy="ddp"``: re-run the user's command once per extra local rank.

The process the user started becomes local rank 0. It starts local ranks 1..N-1 by running the same command
line again (``python script.py args`` or ``python -m module args``) with ``LOCAL_RANK`` and the rendezvous
variables set, then runs the user's function itself. Re-running the script instead of forking keeps every rank
identical to a normal run (no pickling, works with any code), which is why it is the default.

The parent is responsible for the whole job, so nothing can hang or leak:

* a watchdog thread polls the children; if one exits non-zero, the others are terminated (SIGTERM, then
  SIGKILL after a grace period) and the parent leaves at once with that exit code, after naming the rank that
  failed first and quoting its own error (each child records its uncaught exception in a file given by
  ``FABRIC_ERROR_FILE``, see :mod:`fabric_core.runtime.failures`);
* an uncaught exception in the parent terminates the children right after its traceback is printed;
* SIGINT and SIGTERM received by the parent are forwarded to every child;
* at normal interpreter exit the parent waits for the children, so the job's exit status covers every rank;
  before waiting it releases its process group, so a child still blocked on a collective that rank 0 will
  never join fails at once instead of after the process-group timeout;
* on Linux every child gets ``PR_SET_PDEATHSIG``: if the parent dies without cleaning up (``SIGKILL``, a
  segfault), the kernel kills the children.

Each child runs in its own process group, so terminating a rank also ends the processes it started (e.g.
DataLoader workers), and a Ctrl-C in the terminal reaches the children once, through the parent.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fabric_core.launchers import processes
from fabric_core.launchers.base import Launcher, start_method_hint
from fabric_core.runtime import failures, hang
from fabric_core.runtime.process_group import release_process_group
from fabric_core.runtime.run import job_environment
from fabric_core.utilities.exceptions import on_failure
from fabric_core.utilities.topology import Topology, export_variables, threads_per_process

if TYPE_CHECKING:
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.strategies.base import Strategy
    from fabric_core.strategies.layout import ProcessPerDevice

#: Set to "1" in every process this launcher starts.
CHILD_FLAG = "FABRIC_LAUNCHER_CHILD"
_POLL_S = 0.05


def script_command(strategy: Strategy | None = None) -> list[str]:
    """The command line that started this interpreter, ready to be run again for another rank of ``strategy``."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name:
        # `python -m pkg` runs `pkg.__main__`; `python -m pkg.__main__` is equivalent and always valid.
        return [sys.executable, *_interpreter_flags(), "-m", spec.name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    main_file = getattr(__main__, "__file__", None)
    if main_file and script and os.path.basename(main_file) == os.path.basename(script):
        script = main_file  # absolute since Python 3.9: still right if the script changed directory since
    if not script or script == "-c" or not os.path.exists(script):
        who = f"`{type(strategy).__name__}`" if strategy is not None else "This strategy"
        alternative = f"start them from a function: {start_method_hint(strategy, 'spawn')}" if strategy is not None else (
            "use a strategy that starts them from a function"
        )
        raise RuntimeError(
            f"{who} starts its other local ranks by re-running your script (launcher 'subprocess'), but this process"
            f" was not started from a script file (sys.argv[0]={script!r}). Run your code as `python script.py`,"
            f" use `fabric run`, or {alternative}, and pass that function to `fabric.launch()`."
        )
    # Console scripts made by pip are Python files too, so the interpreter can always run the file.
    return [sys.executable, *_interpreter_flags(), os.path.abspath(script), *sys.argv[1:]]


def _interpreter_flags() -> list[str]:
    """Flags such as ``-X faulthandler`` or ``-W error`` that this interpreter was started with."""
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)  # what multiprocessing uses too
    return list(flags()) if callable(flags) else []


def error_file(error_dir: str, local_rank: int) -> str:
    """Where the child of ``local_rank`` writes its uncaught exception (see :mod:`fabric_core.runtime.failures`)."""
    return os.path.join(error_dir, f"local-rank-{local_rank}.json")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed or broken stream, or none (sys.stdout is None)
            pass


class _ChildGroup:
    """The child processes of one launch, with the machinery that keeps them tied to the parent."""

    def __init__(
        self, processes: list[subprocess.Popen], local_ranks: list[int], error_dir: str | None = None
    ) -> None:
        self.processes = processes
        self.local_ranks = local_ranks
        #: where each child writes its uncaught exception (``failures.ERROR_FILE_VARIABLE``); removed at the end
        self.error_dir = error_dir
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, Any] = {}
        self._previous_excepthook: Any = None
        self._terminated = False
        self._interrupts = 0
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None

    # ------------------------------------------------------------------------------------------------ teardown
    def terminate(self, grace: float | None = None) -> None:
        """SIGTERM every running child's process group, then SIGKILL what is left after ``grace`` seconds.

        Runs once; later calls return immediately (the process groups may not exist any more).
        """
        hang.stop_watchdog()  # the job is ending: a stall from here on is the teardown's, not a hang
        self._stopping.set()
        with self._lock:
            if self._terminated:
                return
            self._terminated = True
            processes.stop_processes(self.processes, grace)
            if self.error_dir is not None:
                shutil.rmtree(self.error_dir, ignore_errors=True)

    def _abort(self, code: int, report: str) -> None:
        """End the whole job now, from any thread: report, stop the children, then leave without unwinding."""
        if self._stopping.is_set():
            return
        _flush()
        sys.stderr.write(f"{report}[fabric] Terminating the remaining processes.\n")
        _flush()
        self.terminate()
        _flush()
        os._exit(code)

    def _failures(self, raised: bool = False) -> list[failures.RankFailure]:
        """Every child that has exited non-zero, with the error it recorded (if it raised one).

        With ``raised``, also a child still running that has recorded an uncaught exception: it is on its way out
        (exit code 1), but may need a while, and its peers can fail before it is gone.
        """
        found = []
        for rank, process in zip(self.local_ranks, self.processes):
            code = process.poll()
            if code == 0:
                continue
            error = failures.read_error_file(error_file(self.error_dir, rank)) if self.error_dir else None
            if code is None and raised and error is not None:
                try:  # it is on its way out: its own exit code says more than our guess
                    code = process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                if code == 0:
                    continue
            if code is not None or (raised and error is not None):
                exit_code = processes.exit_status(code) if code is not None else 1
                found.append(failures.RankFailure(f"Local rank {rank}", process.pid, exit_code, error))
        return found

    def _check(self) -> bool:
        """Abort the job if a child failed; return whether any child is still running."""
        failed = self._failures()
        if failed:
            self._abort(failures.job_exit_code(failed), failures.report_failures(failed))
        return any(process.poll() is None for process in self.processes)

    # ------------------------------------------------------------------------------------------------ hooks
    def install(self) -> None:
        hang.on_hang(self._on_hang)
        threading.Thread(target=self._watch, name="fabric-child-watchdog", daemon=True).start()
        atexit.register(self._at_exit)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()

    def _watch(self) -> None:
        while not self._stopping.is_set() and self._check():
            time.sleep(_POLL_S)

    def _on_hang(self, own: failures.RecordedError) -> None:
        """Rank 0 (this process) made no progress: report it with what the children did, and end the job."""
        everyone = [*self._failures(raised=True), failures.RankFailure("Local rank 0", os.getpid(), hang.HANG_EXIT_CODE, own)]
        self._abort(hang.HANG_EXIT_CODE, failures.report_failures(everyone))

    def _failed_children(self, wait: float) -> list[failures.RankFailure]:
        """The children that exited non-zero, waiting up to ``wait`` s for one."""
        deadline = time.monotonic() + wait
        while True:
            failed = self._failures(raised=True)
            if failed or time.monotonic() >= deadline or all(p.poll() is not None for p in self.processes):
                return failed
            time.sleep(_POLL_S)

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous = self._previous_excepthook or sys.__excepthook__
        raised_ns = time.time_ns()
        self._stopping.set()  # the children's deaths below are ours, not failures to report
        # Rank 0 failing in a collective is often the *consequence* of another rank dying (its connections close):
        # name the rank that failed first, quote its own error and exit with its code, as torchrun does, instead of
        # ending on rank 0's gloo traceback.
        # A child that died can take seconds to be reaped on a loaded machine (seen: over 1 s at load 12, when rank
        # 0 then reported only its own gloo error and exited 1): wait a few for it; a rank 0 that failed on its own,
        # with healthy children, pays this once, on its way out.
        failed = self._failed_children(wait=3.0) if not issubclass(exc_type, KeyboardInterrupt) else []
        if failed and sys.__stderr__ is not None:
            # This hook ends the process below; a hook installed after ours (torch's init_process_group wraps it to
            # prefix "[rankN]") may have pointed sys.stderr at a buffer it would only print after we return.
            sys.stderr = sys.__stderr__
        try:
            previous(exc_type, exc, tb)
        finally:
            _flush()
            code = None
            if failed:
                own = failures.RecordedError(
                    f"{exc_type.__name__}: {exc}", "".join(traceback.format_exception(exc_type, exc, tb)), raised_ns
                )
                everyone = [*failed, failures.RankFailure("Local rank 0", os.getpid(), 1, own)]
                code = failures.job_exit_code(everyone)
                sys.stderr.write(failures.report_failures(everyone) + "[fabric] Terminating the remaining processes.\n")
                _flush()
            self.terminate()
            if code is not None:
                os._exit(code)

    # ------------------------------------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        """Forward SIGINT/SIGTERM to the children, even while the main thread is stuck in a collective.

        A Python signal handler only runs when the main thread returns to the interpreter, which a rank blocked
        in a C++ collective never does. Python's C-level handler also writes the signal number to the "wakeup
        fd" at once, so a helper thread reading it reacts immediately; the Python-level handler then only has
        to run what was installed before (e.g. raise ``KeyboardInterrupt``).
        """
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue  # the user (or nohup, or a background shell) chose to ignore it; so do we
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)
        if not self._previous_handlers:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            reader.close()
            writer.close()
            return
        self._wakeup = (reader, writer, old_fd)
        threading.Thread(target=self._signal_thread, name="fabric-signal-forwarder", daemon=True).start()

    def _signal_thread(self) -> None:
        reader, _, old_fd = self._wakeup  # type: ignore[misc]
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if old_fd >= 0:  # keep a wakeup fd installed before ours (e.g. asyncio's) working
                try:
                    os.write(old_fd, data)
                except OSError:
                    pass
            for signum in data:
                if signum in self._previous_handlers:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        """Forward ``signum``; end the job now if its previous disposition was "terminate".

        A second SIGINT also ends the job: the first one only raises ``KeyboardInterrupt``, which a rank stuck
        in a collective never sees.
        """
        self._forward(signum)
        if signum == signal.SIGINT:
            self._interrupts += 1
        if self._previous_handlers.get(signum) == signal.SIG_DFL or self._interrupts >= 2:
            self.terminate()
            _flush()
            os._exit(128 + signum)
        if signum == signal.SIGINT:
            sys.stderr.write("[fabric] Interrupted; press Ctrl-C again to terminate all processes.\n")

    def _forward(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                processes.signal_process_group(process, signum)

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous_handlers.get(signum)
        if self._wakeup is None:
            if callable(previous):
                self._forward(signum)
            else:
                self._handle(signum)
        if callable(previous):
            previous(signum, frame)  # SIGINT: KeyboardInterrupt here; the children got theirs

    def _at_exit(self) -> None:
        if self._stopping.is_set():
            self.terminate()
            return
        # Normal exit of rank 0: the job ends when every rank has ended, and fails if any rank failed. Rank 0
        # has passed all its collectives, so a child still waiting in one can never finish: dropping the
        # process group makes such a child fail now rather than at the process-group timeout.
        release_process_group()
        while self._check():
            time.sleep(_POLL_S)
        self.terminate(grace=0.5)  # only sweeps leftover grandchildren


class SubprocessScriptLauncher(Launcher):
    """Start local ranks 1..N-1 as new runs of the user's command; run local rank 0 in this process.

    Not usable from notebooks or ``python -i`` (there is no script to re-run): use ``ddp_notebook`` there.
    """

    requires_function = False
    is_interactive_compatible = False

    strategy: ProcessPerDevice

    def __init__(self, strategy: ProcessPerDevice) -> None:
        super().__init__(strategy)
        self.children: _ChildGroup | None = None
        self._previous: dict[str, str | None] = {}

    @property
    def num_processes(self) -> int:
        return self.strategy.num_processes

    def _export(self, values: dict[str, str], keys: Sequence[str]) -> None:
        for key, value in export_variables({key: values[key] for key in keys}).items():
            self._previous.setdefault(key, value)

    def teardown(self) -> None:
        """Put back the variables this process exported for its job, so a later job here starts clean."""
        for key, value in self._previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._previous.clear()

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        env = self.strategy.cluster_environment
        if self.children is None and env is not None and not env.creates_processes_externally:
            self._start_children(env)
        return function(*args, **kwargs)

    def _topology(self, env: ClusterEnvironment, local_rank: int) -> Topology:
        return self.strategy.configured_topology.with_local_rank(local_rank)

    def child_environment(self, env: ClusterEnvironment, local_rank: int) -> dict[str, str]:
        """The environment of the child for ``local_rank``: this process's plus the rendezvous variables."""
        child = dict(os.environ)
        child.update(self._topology(env, local_rank).environment(env.main_address, env.main_port))
        child[CHILD_FLAG] = "1"
        child.update(job_environment())  # the children belong to this process's job (the run's identity)
        if "OMP_NUM_THREADS" not in os.environ:
            child["OMP_NUM_THREADS"] = str(threads_per_process(self.num_processes))
        return child

    def _start_children(self, env: ClusterEnvironment, command: Sequence[str] | None = None) -> None:
        if command is None:  # one process per node starts no child: nothing to re-run (also under `python -c`)
            command = script_command(self.strategy) if self.num_processes > 1 else []
        command = list(command)
        # Fix the rendezvous in this process first, so rank 0 and the children agree on the (free) port.
        rank_zero_env = self._topology(env, 0).environment(env.main_address, env.main_port)
        self._export(rank_zero_env, ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE"))
        children: list[subprocess.Popen] = []
        ranks = list(range(1, self.num_processes))
        error_dir = tempfile.mkdtemp(prefix="fabric-errors-")
        # Ctrl-C between two starts too: the children started so far must not outlive us
        with on_failure(lambda: _ChildGroup(children, ranks[: len(children)], error_dir).terminate(grace=1.0)):
            for local_rank in ranks:
                child_env = self.child_environment(env, local_rank)
                children.append(processes.start_rank_process(command, child_env, error_file(error_dir, local_rank)))
        # From now on this process is local rank 0 of a complete set of launcher variables: a later `launch()` must
        # not start more children, and a later Fabric in this process sees a consistent job.
        self._export(rank_zero_env, ("LOCAL_RANK", "RANK"))
        self.children = _ChildGroup(children, ranks, error_dir)
        if children:
            self.children.install()
