"""Run a function in N new processes with ``multiprocessing`` (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``).

Unlike the subprocess launcher, this one cannot re-run a script, so ``fabric.launch(fn)`` needs a function. It
is what notebooks use (``fork`` needs no pickling and no ``__main__`` guard) and what users pick when they want
the result of rank 0 back in the calling process.

The calling process only waits: every rank, including rank 0, runs in a child. Rank 0's return value is moved
to the CPU and sent back through a queue. If any worker fails, the others are terminated and the error of the
worker that failed *first* is raised in the caller (``torch.multiprocessing``'s ``ProcessRaisedException``/
``ProcessExitedException``, which carry the worker's traceback), listing the workers that failed after it.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fabric_core.launchers.base import Launcher, start_method_hint
from fabric_core.launchers.processes import die_with_parent, exit_status, stop_processes
from fabric_core.runtime import failures
from fabric_core.runtime.process_group import abandon_at_exit, release_process_group
from fabric_core.runtime.run import job_environment
from fabric_core.utilities.exceptions import on_failure
from fabric_core.utilities.topology import export_rendezvous

if TYPE_CHECKING:
    from fabric_core.strategies.layout import ProcessPerDevice

_POLL_S = 0.05


class MultiProcessingLauncher(Launcher):
    """Start ``strategy.num_processes`` workers with the given ``multiprocessing`` start method.

    Args:
        strategy: the parallel strategy whose processes are started.
        start_method: ``"spawn"`` (default; safe everywhere), ``"fork"`` (fast, works in notebooks, but unsafe
            once CUDA is initialised) or ``"forkserver"``.
    """

    requires_function = True

    strategy: ProcessPerDevice

    def __init__(self, strategy: ProcessPerDevice, start_method: str = "spawn") -> None:
        super().__init__(strategy)
        available = multiprocessing.get_all_start_methods()
        if start_method not in available:
            if start_method == "fork":
                raise ValueError(
                    f"`{type(strategy).__name__}` starts its processes with the 'fork' start method, but process"
                    f" forking is not supported on this platform. Use {start_method_hint(strategy, 'spawn')}"
                    " instead."
                )
            raise ValueError(
                f"The start method {start_method!r} is not available on this platform. Available start methods"
                f" are: {available}."
            )
        self.start_method = start_method

    @property
    def is_interactive_compatible(self) -> bool:  # type: ignore[override]
        # Spawned processes re-import __main__, which a notebook does not have; forked ones inherit it.
        return self.start_method == "fork"

    @property
    def num_processes(self) -> int:
        return self.strategy.num_processes

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` in every worker and return local rank 0's result (on the CPU)."""
        import torch.multiprocessing as mp

        if self.start_method == "fork":
            _check_can_fork(self.strategy)
        else:
            _check_main_guard(self.start_method)
            _check_picklable(function, self.start_method, self.strategy)
        env = self.strategy.cluster_environment
        if env is not None:
            # Decide the rendezvous once, here, so all workers see the same (possibly freshly picked) port.
            export_rendezvous(env)
        context = mp.get_context(self.start_method)
        results = context.SimpleQueue()
        state = _GlobalState.capture() if self.start_method != "fork" else None
        error_dir = tempfile.mkdtemp(prefix="fabric-errors-")  # what workers record of a hang (utilities/hang.py)
        process_context = mp.start_processes(
            _worker,
            args=(self.strategy, function, args, kwargs, results, state, os.getpid(), error_dir, job_environment()),
            nprocs=self.num_processes,
            start_method=self.start_method,
            join=False,
        )
        output: list[Any] = []
        try:
            # Ctrl-C or SIGTERM (turned into an exception) reached only this process, or a worker failed: the others
            # must not keep the job alive (the caller would wait on them at exit).
            with on_failure(lambda: stop_processes(process_context.processes)):
                _join(process_context, results, output, error_dir)
        finally:
            shutil.rmtree(error_dir, ignore_errors=True)
        if not output and not results.empty():
            output.append(results.get())
        return _deserialize(output[0]) if output else None


def _join(process_context: Any, results: Any, output: list[Any], error_dir: str) -> None:
    """Wait until every worker has ended; if one fails, stop the others and raise for the one that failed first.

    torch's ``ProcessContext.join`` raises for the first failed worker in rank order among those it finds dead, which
    after a rank died in the rendezvous is often rank 0 with only "Connection closed by peer", and the real error is
    never shown. Here every worker's exit is looked at, and the exception names the first failure (by the time its
    error was written) and lists the others.
    """
    from multiprocessing.connection import wait

    processes = process_context.processes
    while True:
        if not output and not results.empty():  # read while waiting: a large result would block its worker forever
            output.append(results.get())
        codes = [p.exitcode for p in processes]
        if any(code not in (None, 0) for code in codes):
            stop_processes(processes)
            raise _failure(process_context, [i for i, code in enumerate(codes) if code not in (None, 0)], error_dir)
        if all(code == 0 for code in codes):
            process_context.join()  # lets torch release what it holds for the workers
            return
        wait([p.sentinel for p, code in zip(processes, codes) if code is None], timeout=_POLL_S)


def _error_file(error_dir: str, index: int) -> str:
    """Where worker ``index`` records a failure that ends it without an exception (a hang, utilities/hang.py)."""
    return os.path.join(error_dir, f"worker-{index}.json")


def _spawn_error(path: str | None) -> failures.RecordedError | None:
    """The traceback torch's worker wrapper wrote for a worker that raised (a pickled string), with its time."""
    import pickle

    if not path:
        return None
    try:
        with open(path, "rb") as f:
            text = pickle.load(f)
        written = os.stat(path).st_mtime_ns
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    lines = str(text).strip().splitlines()
    return failures.RecordedError(lines[-1] if lines else "", str(text), written)


def _failure(process_context: Any, exited: list[int], error_dir: str) -> Exception:
    """torch's exception type for the worker that failed first, whose message also lists the workers that failed
    after it. ``exited`` are the workers found dead when the failure was noticed; the others were stopped then, and
    count as failed only if they raised before that."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    found = []
    for index, process in enumerate(process_context.processes):
        error = _spawn_error(process_context.error_files[index]) or failures.read_error_file(_error_file(error_dir, index))
        if index in exited or error is not None:
            code = process.exitcode or 1
            found.append((index, failures.RankFailure(f"Process {index}", process.pid, exit_status(code), error)))
    order = failures.first_failures([f for _, f in found])
    root = order[0]
    index = next(i for i, f in found if f is root)
    others = "".join(f"\n-- Failed after it (likely a consequence): {f.headline()}" for f in order[1:])
    if root.error is not None:
        message = f"\n\n-- Process {index:d} terminated with the following error:\n{root.error.traceback}{others}"
        return ProcessRaisedException(message, index, root.pid)
    raw = process_context.processes[index].exitcode
    if raw is not None and raw < 0:
        name = signal.Signals(-raw).name if -raw in signal.valid_signals() else f"<Unknown signal {-raw}>"
        return ProcessExitedException(
            f"process {index:d} terminated with signal {name}{others}", index, root.pid, raw, signal_name=name
        )
    return ProcessExitedException(f"process {index:d} terminated with exit code {raw}{others}", index, root.pid, raw)


def _check_main_guard(start_method: str) -> None:
    """A spawned child re-imports the main script; without a ``__main__`` guard it would launch again."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"Launching multiple processes with the {start_method!r} start method requires that your script guards"
            ' the main function with an `if __name__ == "__main__"` clause: every new process imports the script,'
            " and without the guard it would call `fabric.launch()` again. Put the code that creates Fabric and"
            " launches under that guard."
        )


def _check_picklable(function: Callable[..., Any], start_method: str, strategy: ProcessPerDevice) -> None:
    import pickle

    try:
        pickle.dumps(function)
    except (pickle.PicklingError, TypeError, AttributeError) as err:  # a lambda, a local function, a lock inside
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            f"`fabric.launch({name})` with start method {start_method!r} sends the function to new processes by"
            f" pickling it, and it cannot be pickled ({type(err).__name__}: {err}). Define it at the top level of a"
            f" module (not inside another function, not a lambda), or start `{type(strategy).__name__}`'s processes"
            f" without pickling: {start_method_hint(strategy, 'fork')}, or by re-running the script:"
            f" {start_method_hint(strategy, 'popen')}."
        ) from err


def _check_can_fork(strategy: ProcessPerDevice) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "Cannot re-initialize CUDA in forked subprocess: CUDA was already initialized in this process, and"
            " forked processes cannot use it. To use CUDA with multiprocessing, you must use the 'spawn' start"
            f" method ({start_method_hint(strategy, 'spawn')}) or avoid CUDA initialization (`torch.cuda.*`, moving"
            " tensors to the GPU) before `fabric.launch()`."
        )


def _worker(
    process_idx: int,
    strategy: ProcessPerDevice,
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    results: Any,
    state: _GlobalState | None,
    caller_pid: int,
    error_dir: str,
    job: dict[str, str],
) -> None:
    """What each worker runs: take its rank, restore the caller's global state, run, report rank 0's result."""
    # No orphans: if the caller is killed, its workers go too (a forkserver is their parent: do not compare).
    die_with_parent(caller_pid if os.getppid() == caller_pid else None)
    os.environ[failures.ERROR_FILE_VARIABLE] = _error_file(error_dir, process_idx)
    os.environ.update(job)  # the workers belong to the caller's job (the run's identity, runtime/run.py)
    if state is not None:
        state.restore()
        # Tensors that travelled through spawn's pickling live in shared memory, so every worker would train
        # the *same* CPU parameters; give each worker its own copy.
        args, kwargs = _unshare_modules((args, kwargs))
    os.environ["LOCAL_RANK"] = str(process_idx)
    env = strategy.cluster_environment
    if env is not None:
        topology = strategy.configured_topology.with_local_rank(process_idx)
        env.set_global_rank(topology.global_rank)
        env.set_world_size(topology.world_size)
    with on_failure(abandon_at_exit):  # the caller reports this worker's error, not the ones its peers would get
        result = function(*args, **kwargs)
    if process_idx == 0:
        results.put(_serialize(result))
    release_process_group()  # before the worker's interpreter shuts down (see utilities/process_group.py)


def _serialize(result: Any) -> bytes:
    """Rank 0's result as bytes on the CPU.

    Tensors put on a ``torch.multiprocessing`` queue travel as shared-memory handles that die with the worker,
    and the worker exits right after sending; plain bytes have no such lifetime.
    """
    import io

    import torch

    from fabric_core.utilities.apply import move_data_to_device

    buffer = io.BytesIO()
    torch.save(move_data_to_device(result, "cpu"), buffer)
    return buffer.getvalue()


def _deserialize(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # written a moment ago by our own worker


def _unshare_modules(data: Any) -> Any:
    import torch
    from torch.nn import Module

    from fabric_core.utilities.apply import apply_to_collection

    def unshare(module: Module) -> Module:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device.type == "cpu" and tensor.is_shared():
                    tensor.data = tensor.data.clone()
        return module

    return apply_to_collection(data, Module, unshare)


@dataclass
class _GlobalState:
    """Process-wide settings a spawned worker would otherwise lose (it starts from a fresh interpreter)."""

    torch_rng: Any
    python_rng: Any
    numpy_rng: Any
    deterministic: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool

    @classmethod
    def capture(cls) -> _GlobalState:
        import torch

        try:
            import numpy

            numpy_rng = numpy.random.get_state()
        except ImportError:
            numpy_rng = None
        return cls(
            torch_rng=torch.get_rng_state(),
            python_rng=random.getstate(),
            numpy_rng=numpy_rng,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
        )

    def restore(self) -> None:
        import torch

        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            import numpy

            numpy.random.set_state(self.numpy_rng)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
