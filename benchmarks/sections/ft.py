"""Fault tolerance when nothing fails: steady steps/s of ``ft_ddp`` (fabric-ft, torchft) with 2 replica groups over
``ddp`` with 2 ranks, the same loop (``workers/ft_worker.py``), on CPU (gloo, one thread per process).

Each repetition runs both as fresh jobs, in rotated order: ``ddp`` is one process that launches its second rank;
``ft_ddp`` is a lighthouse on loopback (``--min_replicas 2``, so every step has both groups) and one process per
replica group. Every process is started here with a timeout and killed by pid at the end. No bound: the issue asked
for the cost to be shown. (What a failure costs the survivor is measured by
``tests/plugins/ft/test_ft_kill_rejoin.py``, printed with ``-s``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    _JOB_CLEAN_ENV,
    REPO_ROOT,
    child_env,
    dist_version,
    free_port,
    module_available,
    paired_ratios,
    rotated,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section

WORKER = REPO_ROOT / "benchmarks" / "workers" / "ft_worker.py"
FT, DDP = "ft_ddp", "ddp"
WAYS = (FT, DDP)


def unavailable() -> str | None:
    for module in ("fabric_ft", "torchft", "fabric_ddp"):
        if not module_available(module):
            return f"`{module}` is not importable: install fabric-ft and fabric-ddp"
    if not (Path(sys.executable).parent / "torchft_lighthouse").exists():
        return "torchft's `torchft_lighthouse` is not beside this interpreter"
    return None


def _job(way: str, cfg: dict[str, Any], work: Path) -> float:
    out = work / f"{way}-{time.monotonic_ns()}.json"
    env = child_env()
    for key in _JOB_CLEAN_ENV:
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"  # both ways: one thread per process, torchrun's default
    command = [sys.executable, str(WORKER), "ft" if way == FT else "ddp", f"--steps={cfg['steps']}",
               f"--warmup={cfg['warmup']}", f"--width={cfg['width']}", f"--out={out}"]  # fmt: skip
    logs = [open(work / f"{way}-{i}.log", "w") for i in range(3)]
    procs: list[subprocess.Popen] = []
    try:
        if way == FT:
            port = free_port()
            lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}",
                          "--min_replicas", "2", "--join_timeout_ms", "5000"]  # fmt: skip
            procs.append(subprocess.Popen(lighthouse, stdout=logs[0], stderr=subprocess.STDOUT))
            for group in (0, 1):
                group_env = dict(env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2")
                procs.append(subprocess.Popen(command, env=group_env, stdout=logs[group + 1], stderr=subprocess.STDOUT, cwd=REPO_ROOT))
            waited = procs[1:]
        else:
            env["MASTER_PORT"] = str(free_port())
            procs.append(subprocess.Popen(command, env=env, stdout=logs[1], stderr=subprocess.STDOUT, cwd=REPO_ROOT))
            waited = procs
        for proc in waited:
            if proc.wait(cfg["timeout"]) != 0:
                for log in logs:
                    log.flush()
                tail = "".join(Path(log.name).read_text()[-1500:] for log in logs)
                raise RuntimeError(f"{way} job: a process exited with {proc.returncode}:\n{tail}")
        return float(json.loads(out.read_text())["steps_per_s"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for log in logs:
            log.close()


def run(ctx: RunContext) -> dict[str, Any]:
    cfg = dict(ctx.config)
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="fabric-ft-bench-") as tmp:
        for rep in range(cfg["reps"]):
            for way in rotated(WAYS, rep):
                rates[way].append(_job(way, cfg, Path(tmp)))
            ctx.log(f"  ft rep {rep}: ft_ddp {rates[FT][-1]:.1f} steps/s, ddp {rates[DDP][-1]:.1f} steps/s")
    return {
        "config": cfg,
        "torchft": dist_version("torchft"),
        "steps_per_s": {way: summarize(rates[way]) for way in WAYS},
        "steps_ratio": {FT: paired_ratios(rates[FT], rates[DDP])},
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    lines = [
        f"### Fault tolerance: `ft_ddp` (fabric-ft, torchft {result.get('torchft')}) vs `ddp`, nothing failing",
        "",
        f"2 replica groups of one process (a loopback lighthouse, `--min_replicas 2`) against 2 DDP ranks: an MLP"
        f" 256-{cfg['width']}-{cfg['width']}-1, batch 32, SGD, one thread per process, gloo; steps {cfg['warmup']}.."
        f"{cfg['steps']} of the first process timed; {cfg['reps']} repetition(s), fresh jobs in rotated order. No bound:"
        " the per-step quorum and commit RPCs to the lighthouse are the price of going on when a group dies, and"
        " they shrink relative to larger steps.",
        "",
    ]
    ratio = result["steps_ratio"][FT]
    rows = [
        ["`ddp` (2 ranks)", stat(result["steps_per_s"][DDP]), "1 (baseline)"],
        ["`ft_ddp` (2 replica groups)", stat(result["steps_per_s"][FT]), stat(ratio)],
    ]
    lines += table(["strategy", "steps/s", "steps/s vs ddp"], rows)
    return "\n".join(lines) + "\n"


SECTION = Section(
    name="ft",
    order=95,
    modes={
        "full": {"reps": 5, "width": 512, "warmup": 30, "steps": 400, "timeout": 600},
        "quick": {"reps": 2, "width": 512, "warmup": 20, "steps": 150, "timeout": 600},
        "tiny": {"reps": 1, "width": 32, "warmup": 2, "steps": 5, "timeout": 300},
    },
    run=run,
    render=render,
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=3600,
)
