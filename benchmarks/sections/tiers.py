"""Checkpoint tiers (issue 39): what a memory snapshot every step costs, what a save in flight does to the step, how
many steps a failure loses, and how long a restart takes from a peer's memory against a disk checkpoint.

* **snapshot** (``workers/tiers_worker.py steps``, one process, one training thread): an MLP whose parameters and
  AdamW states make ``state_mib``; steps with a memory snapshot every step against none, in interleaved blocks;
* **save in flight** (same process): steps while one save of the whole state is in flight, the keeper's process
  (``checkpoint_tiers(disk_every=1)``: snapshot into shared memory, the keeper serialises and writes) against
  today's thread (``fabric.save(..., async_save=True)``) and against no save; then the same at 2 ddp ranks
  (torchrun), reported without a target;
* **steps lost** (``tiers_worker.py lost``): a small run SIGKILLed at a random moment, with a memory snapshot every
  step or a disk checkpoint every 50 steps; a new process resumes from ``latest_checkpoint``;
* **recovery** (``tiers_worker.py recover``): 2 simulated nodes (two ``fabric run --num-nodes 2`` agents on
  loopback, each with its own shared-memory folder), ddp, 1 or 2 ranks per node; at step k one node's ranks are
  SIGKILLed (memory: its keeper too, and its folder wiped, so its ranks fetch their peer copies), both agents restart
  their workers; the restart is timed phase by phase, and the *reload part* (tiers set-up, ``latest_checkpoint``,
  ``load``, then every restored tensor read and written once, unchanged, on every rank: a memory-mapped disk load
  reads a page at its first touch, and the first step would pay it) is what the target compares. Disk: the
  checkpoint's pages evicted first (``posix_fadvise(DONTNEED)``, *cold*) or left in the page cache (*warm*);
* **recompilation** (``tiers_worker.py compile``): the first compiled step of a fresh process with an empty inductor
  cache, with the artifacts ``fabric_core.runtime.compile_cache`` keeps in the run folder, and with a warm local cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks._common import (
    OURS,
    REPO_ROOT,
    free_port,
    job_env,
    module_available,
    paired_ratios,
    run_child,
    run_job,
    summarize,
)
from benchmarks.report import number, stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = REPO_ROOT / "benchmarks" / "workers" / "tiers_worker.py"
#: c10d rendezvous on a busy 2-core machine: generous heartbeats; one agent hosts the store (tests/plugins/ddp/
#: test_tiers_across_nodes.py).
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=5,join_timeout=120"
PHASES = (
    ("restart", "kill -> process start", "kill", "process_start"),
    ("start", "imports, Fabric(), rendezvous", "process_start", "fabric"),
    ("build", "model, optimizer, setup", "fabric", "built"),
    ("setup", "tiers set-up", "built", "tiers"),
    ("latest", "latest_checkpoint", "tiers", "found"),
    ("load", "load", "found", "loaded"),
    ("touch", "first touch of every tensor", "loaded", "touched"),
    ("step", "first step", "touched", "first_step"),
)


def unavailable() -> str | None:
    if sys.platform != "linux":
        return "needs Linux (/dev/shm, /proc, posix_fadvise)"
    return None if module_available("fabric_ddp") else "`fabric_ddp` is not importable: install fabric-ddp"


def _memory_root(tag: str) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"fabric-tiersbench-{os.getpid()}-{tag}"


def _kill_keepers(root: Path) -> None:
    """End the keepers this section's runs started (by the pid each recorded), then free their memory."""
    for info in root.rglob("keeper.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
            os.kill(int(json.loads(info.read_text())["pid"]), signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = job_env({"PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", **extra})
    env["OMP_NUM_THREADS"] = "1"
    return env


# ------------------------------------------------------------------------------------------------------ steps
def _steps(cfg: dict[str, Any], ranks: int, work: Path, tag: str) -> dict[str, Any]:
    memory = _memory_root(tag)
    variables = {"FABRIC_MEMORY_DIR": str(memory), "FABRIC_RUN_DIR": str(work / tag / "run")}
    args = [str(work / tag), str(cfg["state_mib"]), str(cfg["batch"]), str(cfg["steps"]), str(cfg["reps"])]
    try:
        if ranks == 1:
            return run_child(
                [str(WORKER), "steps", *args],
                timeout=cfg["timeout"],
                env=_env(variables),
            )
        return run_job(
            str(WORKER),
            ["steps", *args],
            nproc=ranks,
            timeout=cfg["timeout"],
            env_extra=variables,
        )
    finally:
        _kill_keepers(memory)


def _median(values: list[float]) -> float:
    return summarize(values)["median"]


def _paired(blocks: list[dict[str, float | None]], variant: str, base: str) -> dict[str, Any]:
    """The ratio of ``variant``'s median step to ``base``'s within each rep (blocks next to each other in time), then
    their spread across reps: this VM's speed drifts over seconds (steps without a snapshot ran 0.27 s in one block and
    0.53 s in another), and a ratio of medians pooled over the whole run once came out at 0.77."""
    kept = [b for b in blocks if b.get(variant) and b.get(base)]  # a save done before any step overlapped it: none
    return paired_ratios([b[variant] for b in kept], [b[base] for b in kept])


def _steps_result(raw: dict[str, Any]) -> dict[str, Any]:
    snap, flight = raw["snapshot"], raw["inflight"]
    return {
        "state_mib": raw["state_mib"],
        "world_size": raw["world_size"],
        "step_s": {k: summarize(v) for k, v in snap.items()},
        "snapshot_ratio": {OURS: _paired(raw["snapshot_blocks"], "memory", "off")},
        "snapshot_call_s": summarize([v for v in raw["snapshot_call_s"] if v is not None]),
        "inflight_step_s": {k: summarize(v) for k, v in flight.items()},
        "inflight_ratio": {
            OURS: _paired(raw["inflight_blocks"], "process", "none"),
            "thread": _paired(raw["inflight_blocks"], "thread", "none"),
        },
        "save_call_s": {k: summarize(v) for k, v in raw["save_call_s"].items()},
        "save_total_s": {k: summarize(v) for k, v in raw["save_total_s"].items()},
        "steps_in_flight": {k: summarize(v) for k, v in raw["steps_in_flight"].items()},
    }


# ------------------------------------------------------------------------------------------------------ lost
def _lost_once(variant: str, kill_after: float, work: Path, timeout: float) -> dict[str, Any]:
    memory = _memory_root(f"lost-{work.name}")
    env = _env({"FABRIC_MEMORY_DIR": str(memory), "FABRIC_MEMORY_LINGER": "120"})
    try:
        killed = subprocess.run([sys.executable, str(WORKER), "lost", str(work), variant, str(kill_after)],
                                capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout)  # fmt: skip
        if killed.returncode != -signal.SIGKILL:
            raise RuntimeError(
                f"lost/{variant}: the run exited with {killed.returncode}, not SIGKILL:\n{killed.stderr[-2500:]}"
            )
        progress = (work / "progress").read_text().split() if (work / "progress").exists() else []
        reached = int(progress[-1]) if progress else 0
        resumed = run_child([str(WORKER), "lost", str(work), variant, "0"], timeout=timeout, env=env)
    finally:
        _kill_keepers(memory)
    return {
        "reached": reached,
        "resumed": resumed["resumed"],
        "lost": reached - resumed["resumed"],
        "from": resumed["from"],
    }


# ------------------------------------------------------------------------------------------------------ recovery
def _start_agent(
    out: Path, name: str, port: int, memory: Path, host: bool, per_node: int, env: dict[str, str]
) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "fabric_core", "run", "--num-nodes", "2", "--rdzv-backend", "c10d", "--main-port", str(port),
        "--max-restarts", "1", "--rdzv-conf", f"{RDZV_CONF},is_host={int(host)}", "--accelerator", "cpu",
        "--devices", str(per_node), str(WORKER), "recover", str(out),
    ]  # fmt: skip
    log = open(out / f"agent-{name}.log", "wb")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True,
                                env={**env, "FABRIC_MEMORY_DIR": str(memory), "TB_NODE": name})  # fmt: skip
    finally:
        log.close()


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


def _evict(path: Path) -> dict[str, Any]:
    """Drop ``path``'s pages from the page cache (written back first: dirty pages cannot be dropped); what stays
    resident afterwards, as ``fincore`` counts it where installed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    resident = None
    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
        done = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        resident = int(done.stdout.split()[0])
    return {"bytes": path.stat().st_size, "resident_after": resident}


def _parked(out: Path) -> list[dict[str, Any]]:
    """The ranks that wrote their pids (a file still being written is read at the next poll)."""
    found = []
    for path in (out / "pids").glob("*.json") if (out / "pids").exists() else []:
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def _wait_for(predicate, timeout: float, agents: dict[str, subprocess.Popen], out: Path, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(a.poll() not in (None, 0) for a in agents.values()):
            logs = "\n".join(
                f"--- agent {n} ---\n" + (out / f"agent-{n}.log").read_text(errors="replace")[-2500:]
                for n in agents
            )
            raise RuntimeError(
                f"recovery: {what} did not happen (exit codes {[a.poll() for a in agents.values()]}):\n{logs}"
            )
        time.sleep(0.05)


def _recover_once(cfg: dict[str, Any], tier: str, world: int, work: Path) -> dict[str, Any]:
    """One run of 2 agents: train to step ``kill_at``, kill node b, time the restart (see the module)."""
    out = work / f"{tier}-{world}"
    out.mkdir(parents=True)
    memory = _memory_root(f"recover-{work.name}-{tier}-{world}")
    shm = {"a": memory / "a", "b": memory / "b"}
    env = _env({
        "TB_TIER": "memory" if tier == "memory" else "disk", "TB_KILL_AT": str(cfg["kill_at"]), "TB_AFTER": "4",
        "TB_VICTIM": "b", "TB_STATE_MIB": str(cfg["recover_mib"]), "FABRIC_RUN_DIR": str(out / "run"),
        "FABRIC_MEMORY_LINGER": "120", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    })  # fmt: skip
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    evicted = None
    try:
        agents["a"] = _start_agent(out, "a", port, shm["a"], True, world // 2, env)
        time.sleep(1.0)  # the store's host first
        agents["b"] = _start_agent(out, "b", port, shm["b"], False, world // 2, env)
        parked = partial(_parked, out)
        _wait_for(
            lambda: len(parked()) == world,
            cfg["timeout"],
            agents,
            out,
            f"{world} ranks parked at step {cfg['kill_at']}",
        )
        if tier == "disk-cold":
            files = sorted((out / "run" / "checkpoints").glob("step-*.ckpt"))
            evicted = [_evict(f) for f in files]
        victims = [p for p in parked() if p["node"] == "b"]
        killed_at = time.time()
        for pid in [v["pid"] for v in victims] + (
            [victims[0]["keeper"]] if tier == "memory" and victims[0]["keeper"] else []
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if tier == "memory":
            shutil.rmtree(shm["b"], ignore_errors=True)  # a replaced node: its memory is empty
        for agent in agents.values():
            agent.wait(cfg["timeout"])
        if any(agent.returncode != 0 for agent in agents.values()):
            _wait_for(lambda: False, 0, agents, out, "a clean end of the restarted run")
    finally:
        for agent in agents.values():
            _kill_group(agent)
        _kill_keepers(memory)
    timeline = json.loads((out / "timeline-1.jsonl").read_text().splitlines()[0])
    loads = [json.loads(line) for line in (out / "reload-1").read_text().splitlines()]
    marks = {"kill": killed_at, **timeline}
    phases = {key: marks[end] - marks[begin] for key, _, begin, end in PHASES}
    ends = timeline["step_ends"]
    steady = min(later - earlier for earlier, later in zip(ends[1:], ends[2:]))
    result = {
        "kill_to_step_s": marks["first_step"] - killed_at,
        "phases_s": phases,
        # what restoring costs, wherever it lands: tiers set-up, latest_checkpoint, load, and the first touch of every
        # restored tensor (a memory-mapped checkpoint is read then; subtracting a steady step from the first one
        # instead swung by +-0.5 s between runs, the memory tier's steady steps carrying a peer copy each)
        "reload_part_s": marks["touched"] - marks["built"],
        "steady_step_s": steady,
        "load_s_max": max(entry["load_s"] for entry in loads),
        "load_s": {f"{e['node']}{e['rank']}": e["load_s"] for e in loads},
        "sources": sorted({str(e["source"]) for e in loads}),
        "resumed_from": timeline.get("latest"),
    }
    if evicted is not None:
        result["evicted"] = evicted
    shutil.rmtree(out / "run", ignore_errors=True)  # the checkpoints: GiBs at 4 ranks
    return result


# ------------------------------------------------------------------------------------------------------ compile
def _compile(cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    artifacts = work / "compile-artifacts"
    results = {}
    for mode, cache in (
        ("cold", work / "inductor-a"),
        ("artifacts", work / "inductor-b"),
        ("warm", work / "inductor-a"),
    ):
        results[mode] = run_child(
            [str(WORKER), "compile", str(work), str(cache), str(artifacts), mode],
            timeout=cfg["timeout"],
            env=_env({}),
        )
    return results


# ------------------------------------------------------------------------------------------------------ run
def run(ctx: RunContext) -> dict[str, Any]:
    cfg = dict(ctx.config)
    base = ctx.options.get("ckpt_dir") or None
    result: dict[str, Any] = {"config": cfg}
    with tempfile.TemporaryDirectory(prefix="fabric-tiers-bench-", dir=base) as tmp:
        work = Path(tmp)
        loads = [os.getloadavg()]
        result["steps"] = _steps_result(_steps(cfg, 1, work, "steps-1"))
        s = result["steps"]
        ctx.log(f"  snapshot every step: {s['snapshot_ratio'][OURS]['median']:.3f}x of a step; save in flight: process"
                f" {s['inflight_ratio'][OURS]['median']:.3f}x, thread {s['inflight_ratio']['thread']['median']:.3f}x")  # fmt: skip
        result["snapshot_ratio"] = s["snapshot_ratio"]
        result["inflight_ratio"] = s["inflight_ratio"]
        for ranks in cfg.get("steps_ranks", []):
            result[f"steps_{ranks}ranks"] = _steps_result(_steps(cfg, ranks, work, f"steps-{ranks}"))
            r = result[f"steps_{ranks}ranks"]
            ctx.log(f"  {ranks} ranks: snapshot {r['snapshot_ratio'][OURS]['median']:.3f}x; in flight: process {r['inflight_ratio'][OURS]['median']:.3f}x,"
                    f" thread {r['inflight_ratio']['thread']['median']:.3f}x")  # fmt: skip
        loads.append(os.getloadavg())

        lost: dict[str, list[dict[str, Any]]] = {"memory": [], "disk": []}
        rng = random.Random(cfg["seed"])
        for rep in range(cfg["lost_reps"]):
            kill_after = rng.uniform(*cfg["kill_after_s"])
            for variant in ("memory", "disk") if rep % 2 == 0 else ("disk", "memory"):
                lost[variant].append(
                    _lost_once(variant, kill_after, work / f"lost-{variant}-{rep}", cfg["timeout"])
                )
        result["lost_runs"] = lost
        result["steps_lost"] = {
            "memory every step": summarize([r["lost"] for r in lost["memory"]]),
            "disk every 50": summarize([r["lost"] for r in lost["disk"]]),
        }
        if cfg["lost_reps"]:
            ctx.log(
                f"  steps lost: memory {[r['lost'] for r in lost['memory']]}, disk {[r['lost'] for r in lost['disk']]}"
            )
        loads.append(os.getloadavg())

        recoveries: dict[str, dict[str, list[dict[str, Any]]]] = {}
        result["recovery_errors"] = {}
        for world, tiers in cfg["recover"].items():
            runs: dict[str, list[dict[str, Any]]] = {tier: [] for tier in tiers}
            try:
                for rep in range(cfg["recover_reps"]):
                    order = tiers[rep % len(tiers) :] + tiers[: rep % len(tiers)]
                    for tier in order:
                        runs[tier].append(_recover_once(cfg, tier, int(world), work / f"recover-{rep}"))
                        r = runs[tier][-1]
                        ctx.log(
                            f"  recovery {tier} at {world} ranks: kill -> step {r['kill_to_step_s']:.2f} s, reload part"
                            f" {r['reload_part_s']:.3f} s (load {r['load_s_max']:.3f} s, steady step {r['steady_step_s']:.3f} s)"
                        )
            except (RuntimeError, OSError, subprocess.SubprocessError) as err:
                if world == next(iter(cfg["recover"])):
                    raise
                # a larger world that does not fit this machine (memory, time) is said, and the smaller one kept
                result["recovery_errors"][world] = f"{type(err).__name__}: {err}"[-3000:]
                ctx.log(f"  recovery at {world} ranks failed: {type(err).__name__}: {str(err)[-500:]}")
                continue
            recoveries[world] = runs
            loads.append(os.getloadavg())
        result["recovery"] = {
            world: {
                tier: {
                    "kill_to_step_s": summarize([r["kill_to_step_s"] for r in rs]),
                    "reload_s": summarize([r["load_s_max"] for r in rs]),
                    "reload_part_s": summarize([r["reload_part_s"] for r in rs]),
                    "steady_step_s": summarize([r["steady_step_s"] for r in rs]),
                    "phases_s": {key: summarize([r["phases_s"][key] for r in rs]) for key, *_ in PHASES},
                    "runs": rs,
                }
                for tier, rs in runs.items()
            }
            for world, runs in recoveries.items()
        }
        result["reload_ratio"] = {}
        for world, runs in recoveries.items():
            if "memory" in runs and "disk-cold" in runs:
                ratios = [
                    m["reload_part_s"] / d["reload_part_s"] for m, d in zip(runs["memory"], runs["disk-cold"])
                ]
                result["reload_ratio"][f"{world} ranks"] = summarize(ratios)
            if "memory" in runs and "disk-warm" in runs:
                ratios = [
                    m["reload_part_s"] / d["reload_part_s"] for m, d in zip(runs["memory"], runs["disk-warm"])
                ]
                result["reload_ratio"][f"{world} ranks, warm disk"] = summarize(ratios)
        largest = f"{max(int(w) for w in recoveries)} ranks"
        if largest in result["reload_ratio"]:  # the target judges the largest world measured
            result["reload_ratio"][OURS] = result["reload_ratio"][largest]

        if cfg.get("compile"):
            try:
                result["compile"] = _compile(cfg, work)
            except (RuntimeError, subprocess.SubprocessError) as err:
                result["compile_error"] = f"{type(err).__name__}: {err}"[-3000:]
                ctx.log(f"  compile failed: {result['compile_error'][-500:]}")
        if "compile" in result:
            ctx.log(
                "  first compiled step: "
                + ", ".join(f"{m} {r['first_step_s']:.1f} s" for m, r in result["compile"].items())
            )
        loads.append(os.getloadavg())
        result["loadavg"] = [list(v) for v in loads]
    return result


# ------------------------------------------------------------------------------------------------------ render
def _steps_table(s: dict[str, Any]) -> list[str]:
    rows = [
        ["no snapshot", stat(s["step_s"]["off"], 3), "1"],
        ["memory snapshot every step", stat(s["step_s"]["memory"], 3), stat(s["snapshot_ratio"][OURS], 3)],
        ["no save in flight", stat(s["inflight_step_s"]["none"], 3), "1"],
        [
            "save in flight: keeper process (ours)",
            stat(s["inflight_step_s"]["process"], 3),
            stat(s["inflight_ratio"][OURS], 3),
        ],
        [
            "save in flight: thread (`async_save=True`)",
            stat(s["inflight_step_s"]["thread"], 3),
            stat(s["inflight_ratio"]["thread"], 3),
        ],
    ]
    return table(["steps", "s per step", "ratio"], rows)


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    s = result["steps"]
    lines = [
        "### Checkpoint tiers: snapshot cost, saves in flight, steps lost, recovery from a peer's memory (issue 39)",
        "",
        f"One process, one training thread (`torch.set_num_threads(1)`; the snapshot thread and the keeper have the other"
        f" core), an MLP of {number(s['state_mib'], 3)} MiB of parameters and AdamW states, batch {cfg['batch']};"
        f" {cfg['reps']} interleaved blocks of {cfg['steps']} steps per setting. A save in flight is one save of the whole"
        " state started before the steps that run until it is written.",
        "",
        *_steps_table(s),
        "",
        f"Save calls (the step's own pause): keeper process {stat(s['save_call_s']['process'], 3)} s, thread"
        f" {stat(s['save_call_s']['thread'], 3)} s; until written: {stat(s['save_total_s']['process'], 3)} s and"
        f" {stat(s['save_total_s']['thread'], 3)} s; snapshot call per step {stat(s['snapshot_call_s'], 3)} s.",
    ]
    for key in sorted(k for k in result if k.startswith("steps_") and k.endswith("ranks")):
        r = result[key]
        lines += ["", f"The same at {r['world_size']} ddp ranks (torchrun; no target):", "", *_steps_table(r)]
    lost = result["steps_lost"]
    lines += (
        []
        if not cfg["lost_reps"]
        else [
            "",
            f"Steps lost per failure (a small run SIGKILLed {cfg['kill_after_s'][0]}-{cfg['kill_after_s'][1]} s in, resumed by a new"
            f" process, {cfg['lost_reps']} kill(s) each): memory snapshot every step {stat(lost['memory every step'], 3)},"
            f" disk checkpoint every 50 steps {stat(lost['disk every 50'], 3)}.",
        ]
    )
    for world, runs in result["recovery"].items():
        rows = []
        for tier, entry in runs.items():
            rows.append([tier, stat(entry["kill_to_step_s"], 3), stat(entry["reload_part_s"], 3), stat(entry["reload_s"], 3)]
                        + [stat(entry["phases_s"][key], 3) for key, *_ in PHASES] + [stat(entry["steady_step_s"], 3)])  # fmt: skip
        lines += [
            "",
            f"Recovery at {world} ranks (2 nodes of {int(world) // 2}, {number(cfg['recover_mib'], 3)} MiB per rank, node b killed at"
            f" step {cfg['kill_at']}; {cfg['recover_reps']} run(s) each), seconds. *Reload part* = tiers set-up, `latest_checkpoint`,"
            " `load` and the first touch of every restored tensor on every rank (read and written once, values unchanged:"
            " a memory-mapped disk checkpoint is read and copied then, as the first step would); *load* = the slowest"
            " rank's `fabric.load`; *steady step* = the fastest of the steps after the second (the memory tier's include"
            " a snapshot and its peer copy):",
            "",
            *table(
                ["tier", "kill -> next step", "reload part", "load", *[label for _, label, *_ in PHASES], "steady step"],
                rows,
            ),
        ]
    ratios = {k: v for k, v in result["reload_ratio"].items() if k != OURS}
    if ratios:
        lines += [
            "",
            "Reload part from memory (peer copies) / from disk: "
            + ", ".join(f"{k} {stat(v, 3)}" for k, v in ratios.items())
            + ".",
        ]
    for world, error in result.get("recovery_errors", {}).items():
        lines += ["", f"Recovery at {world} ranks did not complete here: `{error.splitlines()[0][:300]}`."]
    if "compile" in result:
        c = result["compile"]
        lines += [
            "",
            "First compiled step of a fresh process (`torch.compile`, a small MLP, forward, backward, SGD step): empty inductor"
            f" cache {number(c['cold']['first_step_s'], 3)} s; with the run folder's artifacts ({c['cold']['artifact_bytes']:,} bytes,"
            f" loaded in {number(c['artifacts']['restore_s'], 3)} s) {number(c['artifacts']['first_step_s'], 3)} s; warm local"
            f" cache {number(c['warm']['first_step_s'], 3)} s.",
        ]
    loads = ", ".join("/".join(f"{x:.1f}" for x in v) for v in result.get("loadavg", []))
    lines += ["", f"Load average (1/5/15 min) at the start, after each part: {loads}."]
    return "\n".join(lines) + "\n"


SECTION = Section(
    name="tiers",
    order=96,
    modes={
        "full": {
            "state_mib": 512,
            "batch": 8,
            "steps": 8,
            "reps": 4,
            "steps_ranks": [2],
            "lost_reps": 2,
            "kill_after_s": [6.0, 12.0],
            "seed": 0,
            "recover_mib": 512,
            "recover": {"2": ["memory", "disk-cold", "disk-warm"], "4": ["memory", "disk-cold"]},
            "recover_reps": 3,
            "kill_at": 2,
            "compile": True,
            "timeout": 900,
        },
        "quick": {
            "state_mib": 256,
            "batch": 8,
            "steps": 6,
            "reps": 2,
            "steps_ranks": [],
            "lost_reps": 2,
            "kill_after_s": [5.0, 8.0],
            "seed": 0,
            "recover_mib": 256,
            "recover": {"2": ["memory", "disk-cold", "disk-warm"]},
            "recover_reps": 1,
            "kill_at": 3,
            "compile": True,
            "timeout": 600,
        },
        "tiny": {
            "state_mib": 4,
            "batch": 8,
            "steps": 3,
            "reps": 1,
            "steps_ranks": [],
            "lost_reps": 0,
            "kill_after_s": [2.0, 2.0],
            "seed": 0,
            "recover_mib": 2,
            "recover": {"2": ["memory", "disk-cold"]},
            "recover_reps": 1,
            "kill_at": 1,
            "compile": False,
            "timeout": 300,
        },
    },  # fmt: skip
    run=run,
    render=render,
    targets=(
        Target(
            "tiers_snapshot",
            "memory snapshot every step: step time / without",
            ("snapshot_ratio",),
            "<=",
            1.05,
            comparator=None,
        ),
        Target(
            "tiers_inflight",
            "512 MiB save in flight (keeper process): step time / none; thread beside",
            ("inflight_ratio",),
            "<=",
            1.05,
            comparator="thread",
        ),
        Target(
            "tiers_reload",
            "reload part after a node's loss: memory (peer copies) / cold disk",
            ("reload_ratio",),
            "<=",
            0.3,
            comparator=None,
        ),
    ),
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=5400,
)
