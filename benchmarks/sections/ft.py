"""Fault tolerance when nothing fails, on CPU (gloo, one thread per process), the same loop in every way
(``workers/ft_worker.py``), 2 replica groups of one process (or 2 DDP ranks):

* synchronous: ``ft_ddp`` (fabric-ft) against the same replica group written against torchft directly (its
  ``Manager``, ``DistributedDataParallel`` and ``OptimizerWrapper``: what is left after ours is torchft's own cost),
  and ``ddp`` with 2 ranks (the price of fault tolerance, reported in ms per step);
* semi-synchronous: ``ft_ddp`` with ``semi_sync="diloco"`` against torchft's own ``DiLoCo`` loop, both synchronising
  every ``sync_every`` steps, and beside them two processes that train alone and never communicate (the ceiling).

Each repetition runs every way as fresh jobs, in rotated order: ``ddp`` is one process that launches its second
rank; the replica-group ways are a lighthouse on loopback (``--min_replicas 2``, so every step has both groups) and one
process per group; ``alone`` two processes started together. Every process is started here with a timeout and killed
by pid at the end. Bounds: ``ft_ddp`` >= 0.98x of raw torchft, ``diloco`` >= 0.98x of raw torchft DiLoCo (issue 41).
(What a failure costs the survivor is measured by ``tests/plugins/ft/test_ft_kill_rejoin.py``, printed with ``-s``.)
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
    REPO_ROOT,
    dist_version,
    free_port,
    job_env,
    module_available,
    paired_ratios,
    rotated,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section

WORKER = REPO_ROOT / "benchmarks" / "workers" / "ft_worker.py"
FT, RAW, DDP, DILOCO, RAW_DILOCO, ALONE = "ft_ddp", "raw", "ddp", "diloco", "raw_diloco", "alone"
WAYS = (FT, RAW, DDP, DILOCO, RAW_DILOCO, ALONE)
#: The worker's mode for each way.
MODES = {FT: "ft", RAW: "raw", DDP: "ddp", DILOCO: "diloco", RAW_DILOCO: "raw_diloco", ALONE: "alone"}
#: The bounds of issue 41: ours over raw torchft, synchronous and DiLoCo.
BOUNDS = {FT: 0.98, DILOCO: 0.98}


def unavailable() -> str | None:
    for module in ("fabric_ft", "torchft", "fabric_ddp"):
        if not module_available(module):
            return f"`{module}` is not importable: install fabric-ft and fabric-ddp"
    if not (Path(sys.executable).parent / "torchft_lighthouse").exists():
        return "torchft's `torchft_lighthouse` is not beside this interpreter"
    return None


def _job(way: str, cfg: dict[str, Any], work: Path) -> float:
    out = work / f"{way}-{time.monotonic_ns()}.json"
    env = job_env()
    env["OMP_NUM_THREADS"] = "1"  # both ways: one thread per process, torchrun's default
    command = [sys.executable, str(WORKER), MODES[way], f"--steps={cfg['steps']}", f"--warmup={cfg['warmup']}",
               f"--width={cfg['width']}", f"--sync-every={cfg['sync_every']}", f"--out={out}"]  # fmt: skip
    logs = [open(work / f"{way}-{i}.log", "w") for i in range(3)]
    procs: list[subprocess.Popen] = []
    try:
        if way == ALONE:
            for group in (0, 1):
                procs.append(subprocess.Popen(command, env=dict(env, REPLICA_GROUP_ID=str(group)), stdout=logs[group + 1],
                                              stderr=subprocess.STDOUT, cwd=REPO_ROOT))  # fmt: skip
            waited = procs
        elif way != DDP:
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
            ctx.log(f"  ft rep {rep}: " + ", ".join(f"{way} {rates[way][-1]:.1f}" for way in WAYS) + " steps/s")
    # torchft's own cost per step over plain DDP, and ours over torchft's, from each repetition's pair
    torchft_ms = [1e3 / r - 1e3 / d for r, d in zip(rates[RAW], rates[DDP])]
    ours_ms = [1e3 / f - 1e3 / r for f, r in zip(rates[FT], rates[RAW])]
    ratios = {
        FT: paired_ratios(rates[FT], rates[RAW]),
        "ft_vs_ddp": paired_ratios(rates[FT], rates[DDP]),
        RAW: paired_ratios(rates[RAW], rates[DDP]),
        DILOCO: paired_ratios(rates[DILOCO], rates[RAW_DILOCO]),
        "diloco_vs_alone": paired_ratios(rates[DILOCO], rates[ALONE]),
        "raw_diloco_vs_alone": paired_ratios(rates[RAW_DILOCO], rates[ALONE]),
    }
    return {
        "config": cfg,
        "torchft": dist_version("torchft"),
        "steps_per_s": {way: summarize(rates[way]) for way in WAYS},
        "steps_ratio": ratios,
        "ms_per_step": {"torchft_over_ddp": summarize(torchft_ms), "ours_over_torchft": summarize(ours_ms)},
        "bounds": {way: {"bound": bound, "met": (ratios[way]["median"] or 0) >= bound} for way, bound in BOUNDS.items()},
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    if RAW not in result["steps_per_s"]:  # a result of the section before issue 41 (ft_ddp vs ddp only)
        return f"### Fault tolerance\n\nAn older result (ft_ddp vs ddp: {stat(result['steps_ratio'].get(FT))}).\n"
    rate, ratio, ms = result["steps_per_s"], result["steps_ratio"], result["ms_per_step"]
    met = {way: "met" if v["met"] else "NOT met" for way, v in result["bounds"].items()}
    lines = [
        f"### Fault tolerance (fabric-ft, torchft {result.get('torchft')}), nothing failing",
        "",
        f"2 replica groups of one process (a loopback lighthouse, `--min_replicas 2`), or 2 DDP ranks: an MLP"
        f" 256-{cfg['width']}-{cfg['width']}-1, batch 32, SGD, one thread per process, gloo; steps {cfg['warmup']}.."
        f"{cfg['steps']} of the first process timed; {cfg['reps']} repetition(s), fresh jobs in rotated order; DiLoCo"
        f" synchronises every {cfg['sync_every']} steps. `raw`: the same group written against torchft directly (its"
        " Manager, DistributedDataParallel and OptimizerWrapper; its DiLoCo); `alone`: two processes that never"
        " communicate.",
        "",
    ]
    rows = [
        ["`ddp` (2 ranks)", stat(rate[DDP]), "1 (baseline)", ""],
        ["raw torchft (2 groups)", stat(rate[RAW]), stat(ratio[RAW]), ""],
        ["`ft_ddp` (2 groups)", stat(rate[FT]), stat(ratio["ft_vs_ddp"]), f"{stat(ratio[FT])} ({met[FT]}: >= 0.98)"],
        ["alone (never communicates)", stat(rate[ALONE]), "", ""],
        ["raw torchft DiLoCo", stat(rate[RAW_DILOCO]), "", f"{stat(ratio['raw_diloco_vs_alone'])} of alone"],
        ["`ft_ddp`, `semi_sync='diloco'`", stat(rate[DILOCO]), "", f"{stat(ratio[DILOCO])} ({met[DILOCO]}: >= 0.98);"
         f" {stat(ratio['diloco_vs_alone'])} of alone"],
    ]  # fmt: skip
    lines += table(["way", "steps/s", "vs ddp", "vs raw torchft"], rows)
    lines += [
        "",
        f"torchft's own cost per step over `ddp`: {stat(ms['torchft_over_ddp'], fixed=2)} ms; ours over torchft's:"
        f" {stat(ms['ours_over_torchft'], fixed=2)} ms.",
    ]
    return "\n".join(lines) + "\n"


SECTION = Section(
    name="ft",
    order=95,
    modes={
        "full": {"reps": 7, "width": 512, "warmup": 30, "steps": 400, "sync_every": 20, "timeout": 600},
        "quick": {"reps": 2, "width": 512, "warmup": 20, "steps": 150, "sync_every": 20, "timeout": 600},
        "tiny": {"reps": 1, "width": 32, "warmup": 2, "steps": 5, "sync_every": 2, "timeout": 300},
    },
    run=run,
    render=render,
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=3600,
)
