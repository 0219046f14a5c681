"""Helpers shared by the benchmark sections: statistics, interleaving, child processes, machine facts, memory.

This module must stay importable without torch: the harness process itself never imports torch, so its own
state cannot influence what the child processes measure.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_JSON "

#: The variant names used in every section.
RAW, OURS, LIGHTNING = "raw", "ours", "lightning"


# ------------------------------------------------------------------------------------------------ statistics
def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median and range of repeated measurements (the raw values are kept for anyone who wants more)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
    }


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """Ratios of measurements taken in the same repetition, summarised: pairs cancel slow drifts of the machine."""
    return summarize([n / d for n, d in zip(numerator, denominator) if d])


def rotated(items: Sequence[str], rep: int) -> list[str]:
    """The order of the variants in repetition ``rep``: A B C, then B C A, ... so no variant always goes first."""
    k = rep % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


# ------------------------------------------------------------------------------------------------ environment
def lightning_available() -> bool:
    return importlib.util.find_spec("lightning_fabric") is not None


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_plugins() -> list[dict[str, str | None]]:
    """The ``fabric.plugins`` entry points of this environment (what ``Fabric(...)`` will load)."""
    out = []
    for ep in metadata.entry_points(group="fabric.plugins"):
        dist = getattr(ep, "dist", None)
        out.append(
            {
                "name": ep.name,
                "value": ep.value,
                "distribution": dist.name if dist else None,
                "version": dist.version if dist else None,
            }
        )
    return sorted(out, key=lambda e: str(e["name"]))


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key:`` line of a Linux ``/proc`` file in KiB (``MemTotal`` of ``/proc/meminfo``, ``VmRSS`` of
    ``/proc/self/status``); ``None`` without it."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: cores, RAM, CPU, versions, and the load while we ran."""
    mem = _proc_kib("/proc/meminfo", "MemTotal")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gib": round(mem / 2**20, 1) if mem else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": dist_version("torch"),
        "fabric_core": dist_version("fabric-core"),
        "lightning_fabric": dist_version("lightning-fabric"),
        "deepspeed": dist_version("deepspeed"),
        "loadavg_at_start": list(load) if load else None,
        "plugins": installed_plugins(),
    }


# ------------------------------------------------------------------------------------------------ child processes
def emit(result: Any) -> None:
    """Hand a child's result to the harness: one line on stdout with a fixed prefix (other output is ignored)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def train_step(model: Any, optimizer: Any, x: Any, target: Any, fabric: Any = None) -> Any:
    """One MSE step of the workers' loops: ``fabric.backward`` under a Fabric, ``loss.backward()`` without it."""
    import torch.nn.functional as F

    loss = F.mse_loss(model(x), target)
    if fabric is None:
        loss.backward()
    else:
        fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def timed_training(model: Any, optimizer: Any, x: Any, target: Any, fabric: Any, warmup: int, steps: int) -> dict:
    """The workers' loop: ``warmup + steps`` MSE steps (``fabric.backward`` under a Fabric, ``loss.backward()``
    without), timed one by one. Returns the moment the first step ended (``time.time()``), the steady steps/s (the
    median step: a step in which another process of a shared machine preempted us does not count), the mean steps/s
    and the last loss."""
    t_first, durations, loss = 0.0, [], None
    for i in range(warmup + steps):
        t_step = time.perf_counter()
        loss = train_step(model, optimizer, x, target, fabric)
        if i == 0:
            t_first = time.time()
        if i >= warmup:
            durations.append(time.perf_counter() - t_step)
    durations.sort()
    return {
        "t_first": t_first,
        "steady_steps_per_s": 1.0 / durations[len(durations) // 2],
        "mean_steps_per_s": len(durations) / sum(durations),
        "final_loss": float(loss.detach()) if loss is not None else float("nan"),
    }


def emit_training(args: Any, world: int, t0: float, t_imported: float, t_setup: float, timed: dict) -> None:
    """:func:`emit` the result of :func:`timed_training` with the moments of the worker's start-up."""
    import torch

    emit(
        {
            "impl": args.impl,
            "strategy": args.strategy,
            "world_size": world,
            "threads": torch.get_num_threads(),
            "imported_s": t_imported - t0,
            "setup_s": t_setup - t0,
            "first_step_s": timed["t_first"] - t0,
            "steady_steps_per_s": timed["steady_steps_per_s"],
            "mean_steps_per_s": timed["mean_steps_per_s"],
            "final_loss": timed["final_loss"],
        }
    )


def parse_result(stdout: str) -> Any:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError("the child process printed no result line")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    root = str(REPO_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra:
        env.update(extra)
    return env


def run_child(
    args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None, echo: bool = False
) -> Any:
    """Run ``python <args>`` in a fresh interpreter and return the JSON it emitted; errors carry its stderr.

    ``echo=True`` passes the child's stderr (its progress lines) through to ours as it comes.
    """
    cmd = [sys.executable, *args]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env or child_env(), cwd=REPO_ROOT
        )
        tail: list[str] = []

        def read_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if echo:
                    print(line, end="", flush=True)
                tail.append(line)
                del tail[:-60]

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join(10)
        out.seek(0)
        stdout = out.read()
    if returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {returncode}:\n{(''.join(tail) or stdout)[-3000:]}")
    return parse_result(stdout)


def free_port() -> int:
    """A TCP port on the loopback interface that is free now, for a job's rendezvous or a service the section starts
    (the harness's one helper; fabric_core's ``find_free_port`` also honours ``STANDALONE_PORT``, which a benchmark
    must not inherit)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Variables a job must not inherit from the harness's environment: each launcher applies its own defaults.
_JOB_CLEAN_ENV = (
    "OMP_NUM_THREADS",
    "FABRIC_CLI_USED",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job a section starts: :func:`child_env` with ``extra``, without what a launcher sets
    (:data:`_JOB_CLEAN_ENV`: each launcher applies its own defaults)."""
    env = child_env(extra)
    for key in _JOB_CLEAN_ENV:
        env.pop(key, None)
    return env

#: What libstdc++ prints when a native thread is unwound during interpreter finalization (exit code 134/-6).
_EXIT_ABORT = "terminate called without an active exception"


def run_job(
    script: str,
    args: Sequence[str],
    *,
    nproc: int = 2,
    torchrun: bool = True,
    timeout: float = 600,
    env_extra: dict[str, str] | None = None,
) -> Any:
    """Start one ``nproc``-process job of ``script`` and return the result line rank 0 emitted.

    ``torchrun=False`` starts ``python script`` alone (its ``fabric.launch()`` starts the other ranks). The job
    gets ``BENCH_T0``, the moment it was started, for time-to-first-step measurements. A job that reported its
    result and then aborted at interpreter exit (the torch/gloo teardown crash fabric-core guards against,
    docs/decisions.md) keeps its numbers, with ``exit_aborted`` set so the section can count such jobs. ``env_extra``:
    variables added to the job's environment.
    """
    env = job_env(env_extra)
    cmd = [sys.executable, script, *args]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            script,
        ]
        cmd += list(args)
    env["BENCH_T0"] = repr(time.time())
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout)
    if proc.returncode != 0:
        kept = result_of_exit_abort(proc)
        if kept is not None:
            return kept
        raise RuntimeError(
            f"{' '.join(cmd[-len(args) - 1 :])} exited with {proc.returncode}:\n{proc.stderr[-2500:]}"
        )
    return parse_result(proc.stdout)


def result_of_exit_abort(proc: subprocess.CompletedProcess) -> dict[str, Any] | None:
    """The result of a failed job that reported it and then aborted at interpreter exit, marked ``exit_aborted``;
    ``None`` for any other failure. Under torchrun a rank's abort shows as its SIGABRT in the agent's summary."""
    aborted = _EXIT_ABORT in proc.stderr or "(SIGABRT)" in proc.stderr
    if not aborted or RESULT_PREFIX not in proc.stdout:
        return None
    result = parse_result(proc.stdout)
    result["exit_aborted"] = True
    return result


def exit_aborts(samples: dict[str, list[dict[str, Any] | None]]) -> dict[str, int]:
    """Per variant, how many of its jobs reported their result and then crashed at exit."""
    return {v: sum(1 for r in rs if r is not None and r.get("exit_aborted")) for v, rs in samples.items()}


# ------------------------------------------------------------------------------------------------ memory (Linux)
def rss_kib() -> int | None:
    return _proc_kib("/proc/self/status", "VmRSS")


def peak_rss_kib() -> int | None:
    """The process's resident-set high-water mark.

    ``VmHWM`` rather than ``getrusage().ru_maxrss``: the latter also keeps the high-water mark of whatever the
    process was before ``exec`` (a forking parent with torch loaded), so a fresh child would inherit its peak.
    """
    hwm = _proc_kib("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ bytecode
def precompile_fabric_packages() -> list[str]:
    """Write ``.pyc`` files for fabric-core and the installed fabric plugins (editable installs have none).

    Installed wheels (torch, lightning-fabric) were byte-compiled by pip; an editable source tree only gets
    ``__pycache__`` on first import, and never when ``PYTHONDONTWRITEBYTECODE`` is set. Without this, every
    fresh interpreter would compile our sources and the import comparison would measure the compiler.
    """
    names = {"fabric_core"} | {str(p["value"]).split(".")[0].split(":")[0] for p in installed_plugins()}
    folders = []
    for name in sorted(names):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            folders.extend(spec.submodule_search_locations)
    if folders:
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", *folders],
            check=False,
            capture_output=True,
            timeout=300,
        )
    return folders
