"""Goodput (issue 40): what the ledger costs per step, whether equal ranks on a busy machine are ever named
stragglers, and what the chaos schedule's run keeps of its time with our hang detection against ``--max-restarts``
and disk checkpoints alone.

* **overhead** (``workers/goodput_worker.py overhead``, one process): the ledger's three hot-path calls alone (forward
  and backward marks, step end), in µs per step, and a tiny training loop (Linear(32, 32), SGD) with the marks on
  and off in alternating blocks, process CPU time per step;
* **false alarms** (``workers/goodput_worker.py equal``): 4 equal DDP ranks (``fabric.launch()``) train N steps while
  two busy loops keep both cores occupied; every straggler naming and hang report is counted;
* **chaos** (``fabric_core.testing.chaos.run_chaos`` on ``examples/chaos/train.py``, 4 ranks, ``fabric run
  --max-restarts 3``, the same seeded kill, hang and slow): ours (hang limit ``FABRIC_HANG_TIMEOUT=10``) against
  recovery by ``--max-restarts`` and disk checkpoints alone (hang detection off: the stuck rank's peers wait for the
  collective timeout, ``FABRIC_TIMEOUT``, here shortened from torch's 30 minutes to keep the run short). The ledger
  measures both; goodput = its productive share of all ranks' time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import OURS, REPO_ROOT, child_env, module_available, run_child, summarize
from benchmarks.report import number, stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = REPO_ROOT / "benchmarks" / "workers" / "goodput_worker.py"
CHAOS_TRAIN = REPO_ROOT / "examples" / "chaos" / "train.py"


def unavailable() -> str | None:
    return None if module_available("fabric_ddp") else "`fabric_ddp` is not importable: install fabric-ddp"


def _busy(n: int) -> list[subprocess.Popen]:
    code = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def _false_alarms(cfg: dict[str, Any], log: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fabric-goodput-bench-") as tmp:
        busy = _busy(cfg["busy"])
        try:
            env = child_env({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
            for key in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "FABRIC_CLI_USED"):
                env.pop(key, None)
            command = [sys.executable, str(WORKER), "equal", tmp, f"--steps={cfg['equal_steps']}", f"--devices={cfg['devices']}"]
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=cfg["timeout"])
        finally:
            for process in busy:
                process.kill()
                process.wait()
        if done.returncode != 0:
            raise RuntimeError(f"equal ranks job exited with {done.returncode}:\n{done.stderr[-2500:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(cfg["devices"])]
    output = done.stdout + done.stderr
    named = ranks[0]["stragglers"]
    hangs = output.count("made no progress") + output.count("[fabric] Hang:")
    log(f"  equal ranks: {cfg['equal_steps']} steps in {ranks[0]['seconds']:.1f} s with {cfg['busy']} busy loops: {len(named)} straggler(s) named, {hangs} hang report(s)")
    return {"devices": cfg["devices"], "steps": cfg["equal_steps"], "seconds": ranks[0]["seconds"], "stragglers": named, "hang_reports": hangs, "alarms": len(named) + hangs}


def _chaos(cfg: dict[str, Any], hang_detection: bool, out: Path) -> dict[str, Any]:
    from fabric_core.testing.chaos import make_schedule, run_chaos

    kinds = cfg["chaos_faults"].split(",")
    faults = make_schedule(kinds, seed=cfg["seed"], world_size=cfg["devices"], first_step=8, last_step=cfg["chaos_steps"] - 8, slow_steps=cfg["slow_steps"])
    port = 20000 + (os.getpid() * 7 + (1 if hang_detection else 0)) % 10000
    command = [sys.executable, "-m", "fabric_core", "run", "--accelerator", "cpu", "--strategy", "ddp_find_unused_parameters_true"]
    command += ["--devices", str(cfg["devices"]), "--main-port", str(port), "--max-restarts", "3", str(CHAOS_TRAIN), "--steps", str(cfg["chaos_steps"])]
    environment = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if not hang_detection:
        environment.update({"FABRIC_HANG_TIMEOUT": "off", "FABRIC_TIMEOUT": str(cfg["collective_timeout"])})
    started = time.monotonic()
    report = run_chaos(
        command, faults, out=out, hang_timeout=10.0 if hang_detection else None, environment=environment, timeout=cfg["timeout"]
    )
    summary = report.chaos.summary or {}
    return {
        "ok": report.ok,
        "exit_code": report.chaos.exit_code,
        "wall_s": time.monotonic() - started,
        "goodput": summary.get("goodput"),
        "shares": summary.get("shares"),
        "attempts": [{k: r[k] for k in ("outcome", "seconds", "last_step")} for r in summary.get("attempts", [])],
        "schedule": report.schedule,
    }


def run(ctx: RunContext) -> dict[str, Any]:
    cfg = dict(ctx.config)
    overhead = run_child([str(WORKER), "overhead", f"--steps={cfg['loop_steps']}", f"--blocks={cfg['blocks']}"], timeout=cfg["timeout"])
    on, off = overhead["step_on_us"], overhead["step_off_us"]
    ctx.log(f"  ledger hot path {overhead['hot_path_us']:.2f} µs/step; loop {summarize(on)['median']:.1f} vs {summarize(off)['median']:.1f} µs/step")
    result: dict[str, Any] = {
        "config": cfg,
        "hot_path_us": {OURS: summarize([overhead["hot_path_us"]])},
        "step_us": {"ledger on": summarize(on), "ledger off": summarize(off)},
        "step_overhead_us": {OURS: summarize([a - b for a, b in zip(on, off)])},
    }
    if cfg.get("equal_steps"):
        alarms = _false_alarms(cfg, ctx.log)
        result["false_alarms"] = {OURS: summarize([alarms["alarms"]])}
        result["equal_ranks"] = alarms
    if cfg.get("chaos_steps"):
        with tempfile.TemporaryDirectory(prefix="fabric-goodput-chaos-") as tmp:
            runs = {}
            for way, detect in (("ours", True), ("max-restarts alone", False)):
                runs[way] = _chaos(cfg, detect, Path(tmp) / way.replace(" ", "-"))
                ctx.log(f"  chaos, {way}: exit {runs[way]['exit_code']}, {runs[way]['wall_s']:.1f} s, goodput {runs[way]['goodput']}")
        result["chaos"] = runs
        if runs["ours"]["goodput"] and runs["max-restarts alone"]["goodput"]:
            result["goodput_ratio"] = {OURS: summarize([runs["ours"]["goodput"] / runs["max-restarts alone"]["goodput"]])}
    return result


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    lines = [
        "### Goodput: the ledger's cost, false straggler alarms, and a chaos schedule's goodput (issue 40)",
        "",
        f"The ledger's three hot-path calls per step (forward and backward marks, step end): {stat(result['hot_path_us'][OURS], 2)} µs"
        f" per step. A tiny loop (Linear(32, 32), SGD, one process, {cfg['loop_steps']} steps x {cfg['blocks']} blocks"
        " per setting, alternating, process CPU time):",
        "",
        *table(["setting", "µs per step"], [[k, stat(v, 3)] for k, v in result["step_us"].items()]),
        "",
        f"Difference per step (on - off, paired blocks): {stat(result['step_overhead_us'][OURS], 2)} µs.",
    ]
    if "equal_ranks" in result:
        e = result["equal_ranks"]
        lines += [
            "",
            f"False alarms: {e['devices']} equal DDP ranks (`fabric.launch()`), {e['steps']} steps in {number(e['seconds'], 3)} s, while"
            f" {cfg['busy']} busy loops kept both cores occupied: {len(e['stragglers'])} straggler(s) named,"
            f" {e['hang_reports']} hang report(s).",
        ]
    if "chaos" in result:
        rows = []
        for way, r in result["chaos"].items():
            shares = r.get("shares") or {}
            rows.append([way, str(r["exit_code"]), number(r["wall_s"], 3), number(r["goodput"], 3), number(shares.get("restart"), 3),
                         number(shares.get("waiting"), 3), " / ".join(a["outcome"] for a in r["attempts"])])  # fmt: skip
        schedule = ", ".join(f"{f['kind']} of rank {f['ranks'][0]} at step {f['step']}" for f in result["chaos"]["ours"]["schedule"])
        lines += [
            "",
            f"Chaos schedule ({schedule}), {cfg['devices']} ranks, `examples/chaos/train.py` ({cfg['chaos_steps']} steps, a checkpoint every"
            f" 5), `fabric run --max-restarts 3`; ours with `FABRIC_HANG_TIMEOUT=10`, the other with hang detection off and"
            f" `FABRIC_TIMEOUT={cfg['collective_timeout']}` (torch's default is 1,800 s: the gap grows with it):",
            "",
            *table(["recovery", "exit", "wall s", "goodput", "restart share", "waiting share", "attempts"], rows),
        ]
    return "\n".join(lines)


SECTION = Section(
    name="goodput",
    order=95,
    modes={
        "full": {"devices": 4, "loop_steps": 5000, "blocks": 10, "equal_steps": 1000, "busy": 2, "chaos_steps": 50, "chaos_faults": "kill,hang,slow", "slow_steps": 20, "seed": 0, "collective_timeout": 300, "timeout": 1200},
        "quick": {"devices": 4, "loop_steps": 2000, "blocks": 6, "equal_steps": 1000, "busy": 2, "chaos_steps": 50, "chaos_faults": "kill,hang,slow", "slow_steps": 20, "seed": 0, "collective_timeout": 120, "timeout": 900},
        "tiny": {"devices": 2, "loop_steps": 50, "blocks": 2, "equal_steps": 20, "busy": 0, "chaos_steps": 20, "chaos_faults": "slow", "slow_steps": 3, "seed": 0, "collective_timeout": 60, "timeout": 300},
    },
    run=run,
    render=render,
    targets=(
        Target("goodput_hot_path", "goodput ledger: hot-path cost per step (µs)", ("hot_path_us",), "<=", 5.0, comparator=None),
        Target("goodput_false_alarms", "stragglers/hangs named among 4 equal ranks, 1,000 steps, busy cores", ("false_alarms",), "<=", 0.0, comparator=None),
        Target("goodput_chaos", "chaos schedule: goodput with hang detection / --max-restarts alone", ("goodput_ratio",), ">=", 1.0, comparator=None),
    ),
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=3600,
)
