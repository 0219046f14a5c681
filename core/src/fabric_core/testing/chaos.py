"""The chaos harness: run a training command under a seeded schedule of faults and check that it recovered.

``fabric chaos [OPTIONS] -- COMMAND...`` (or :func:`run_chaos` from Python, e.g. in a project's CI)::

    fabric chaos --world-size 4 --faults kill,hang,slow --seed 3 --hang-timeout 10 --weights final.ckpt \\
        -- fabric run --devices 4 --strategy ddp --max-restarts 3 train.py

1. **The schedule** (:func:`make_schedule`): the kinds asked for (``kill``, ``node_kill``, ``hang``, ``slow``,
   ``stop``, ``disk_full``), each at a step drawn from ``--steps`` on a rank drawn from ``--world-size``, seeded:
   the same seed gives the same schedule. ``--schedule`` takes one written out instead (JSON, as ``FABRIC_CHAOS``).
2. **The runs**: with ``--weights``, first the command without faults (the reference), in ``OUT/reference/``; then
   with the schedule in ``FABRIC_CHAOS``, in ``OUT/chaos/``. Each runs in a session of its own, in its own working
   folder, with its own run folder (``FABRIC_RUN_DIR=OUT/<run>/run``); ``--hang-timeout`` sets
   ``FABRIC_HANG_TIMEOUT`` for the chaos run. The ranks fire the faults themselves (:mod:`fabric_core.runtime.chaos`),
   so recovery is the command's own: ``fabric run --max-restarts`` and disk checkpoints, or anything else.
3. **The checks** (:class:`ChaosReport`): the chaos run exited 0; its final weights (the file ``--weights`` names,
   relative to the working folder) equal the reference's exactly; nothing was left behind (no process of its session
   alive after it, no temporary checkpoint file in its folder); the goodput ledger accounts for the time ("other" at
   most ``--max-other`` of all ranks' time), saw one failed attempt per kill, hang and full disk, and named the slow
   rank of a long enough ``slow`` fault.

The script must resume from its newest checkpoint when restarted (docs/decisions.md, "Resuming") and save through
``fabric.save`` (so the ledger knows which step a checkpoint holds).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fabric_core.launchers.processes import session_processes
from fabric_core.runtime.chaos import CHAOS_VARIABLE, Fault
from fabric_core.runtime.hang import HANG_TIMEOUT_VARIABLE
from fabric_core.runtime.run import RUN_DIR_VARIABLE

#: What ``--faults`` accepts (``node_kill``: every rank of one node).
FAULT_KINDS = ("kill", "node_kill", "hang", "slow", "stop", "disk_full")
#: Faults after which the job must restart (one failed attempt each).
RESTARTING = ("kill", "hang", "disk_full")


def make_schedule(
    kinds: list[str],
    *,
    seed: int,
    world_size: int,
    first_step: int,
    last_step: int,
    processes_per_node: int | None = None,
    slow_seconds: float = 0.2,
    slow_steps: int = 20,
    stop_seconds: float = 3.0,
) -> list[Fault]:
    """One fault of each kind in ``kinds`` (repeats allowed), at steps spread over ``[first_step, last_step]`` in a
    seeded random order, on seeded random ranks. ``disk_full`` always hits global rank 0 (the one that writes a
    single-file checkpoint)."""
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"Unknown fault kind(s) {unknown}; choose from {', '.join(FAULT_KINDS)}.")
    if world_size < 1 or last_step < first_step or first_step < 1:
        raise ValueError(
            f"Need world_size >= 1 and 1 <= first_step <= last_step, got {world_size}, {first_step}, {last_step}."
        )
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    span = (last_step - first_step + 1) / max(1, len(order))
    faults = []
    for i, kind in enumerate(order):
        step = first_step + int(i * span + rng.random() * span * 0.5)
        rank = rng.randrange(world_size)
        if kind == "node_kill":
            per_node = processes_per_node or world_size
            faults.append(Fault("kill", step, node=rank // per_node))
        elif kind == "slow":
            faults.append(Fault("slow", step, ranks=[rank], seconds=slow_seconds, steps=slow_steps))
        elif kind == "stop":
            faults.append(Fault("stop", step, ranks=[rank], seconds=stop_seconds))
        elif kind == "disk_full":
            faults.append(Fault("disk_full", step, ranks=[0]))
        else:
            faults.append(Fault(kind, step, ranks=[rank]))
    return sorted(faults, key=lambda f: f.step)


def schedule_json(faults: list[Fault]) -> str:
    return json.dumps({"faults": [asdict(f) for f in faults]})


@dataclass
class RunResult:
    folder: str
    exit_code: int
    seconds: float
    leftover_processes: list[int] = field(default_factory=list)
    leftover_files: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None


@dataclass
class ChaosReport:
    """What a chaos run did and which checks passed (``ok``: all of them)."""

    schedule: list[dict[str, Any]]
    chaos: RunResult
    reference: RunResult | None
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(passed for passed, _ in self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "schedule": self.schedule,
            "chaos": asdict(self.chaos),
            "reference": asdict(self.reference) if self.reference else None,
            "checks": {k: {"passed": p, "detail": d} for k, (p, d) in self.checks.items()},
        }

    def text(self) -> str:
        lines = ["Schedule:"]
        for f in self.schedule:
            who = f"node {f['node']}" if f.get("node") is not None else f"rank(s) {f['ranks']}"
            extra = f", {f['seconds']:g} s x {f['steps']} steps" if f["kind"] == "slow" else f", {f['seconds']:g} s" if f["kind"] == "stop" else ""
            lines.append(f"  step {f['step']:>5}: {f['kind']} on {who}{extra}")
        for name, run in (("reference", self.reference), ("chaos", self.chaos)):
            if run is None:
                continue
            goodput = f", goodput {run.summary['goodput']:.1%}" if run.summary else ""
            lines.append(f"{name}: exit {run.exit_code} after {run.seconds:.1f} s{goodput} ({run.folder})")
        if self.chaos.summary:
            s = self.chaos.summary
            shares = ", ".join(f"{k} {v:.1%}" for k, v in s["shares"].items() if v > 0)
            lines.append(f"chaos run's time: {shares}")
            for row in s["attempts"]:
                per = row["per_rank"]
                lines.append(
                    f"  attempt {row['attempt']}: {row['outcome']}, {row['seconds']:.1f} s, steps to {row['last_step']},"
                    f" restart {per.get('restart', 0.0):.1f} s/rank, redone {per.get('redone', 0.0):.1f} s/rank"
                )
        lines.append("Checks:")
        for name, (passed, detail) in self.checks.items():
            lines.append(f"  [{'ok' if passed else 'FAILED'}] {name}: {detail}")
        return "\n".join(lines) + "\n"


def _run(command: list[str], folder: Path, env: dict[str, str], timeout: float, log: Path) -> RunResult:
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # noqa: S603
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            out.write(f"\n[fabric chaos] the command ran over its {timeout:g} s and was killed\n")
    seconds = time.monotonic() - started
    deadline = time.monotonic() + 15.0  # a stopped rank's SIGCONT helper, a launcher's last children: let them end
    left = session_processes(process.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_processes(process.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    from fabric_core.io.commit import is_temporary

    temporaries = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if is_temporary(p))
    return RunResult(str(folder), code, seconds, left, temporaries)


def _load_weights(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
        if not torch.equal(a, b):
            return [f"{where}: max |difference| {float((a.double() - b.double()).abs().max()):.3g}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ ({sorted(set(a) ^ set(b))[:5]})"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def run_chaos(
    command: list[str],
    faults: list[Fault],
    *,
    out: str | os.PathLike[str],
    weights: str | None = None,
    hang_timeout: float | None = None,
    max_other: float = 0.01,
    timeout: float = 1800.0,
    environment: dict[str, str] | None = None,
) -> ChaosReport:
    """Run ``command`` without faults (when ``weights`` is given) and with ``faults``; check what the module's
    docstring lists. ``environment`` is added to this process's for both runs."""
    from fabric_core.runtime import goodput_report

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    base = {**os.environ, **(environment or {})}
    base.pop(CHAOS_VARIABLE, None)
    reference = None
    if weights is not None:
        env = {**base, RUN_DIR_VARIABLE: str(out / "reference" / "run")}
        reference = _run(command, out / "reference", env, timeout, out / "reference.log")
    env = {**base, RUN_DIR_VARIABLE: str(out / "chaos" / "run"), CHAOS_VARIABLE: schedule_json(faults)}
    if hang_timeout is not None:
        env[HANG_TIMEOUT_VARIABLE] = f"{hang_timeout:g}"
    chaos = _run(command, out / "chaos", env, timeout, out / "chaos.log")
    report = ChaosReport([asdict(f) for f in faults], chaos, reference)
    for run in (reference, chaos):
        if run is not None:
            run.summary = goodput_report.summary_or_none(Path(run.folder) / "run")
    checks = report.checks
    checks["finished"] = (chaos.exit_code == 0, f"exit code {chaos.exit_code} (log: {out / 'chaos.log'})")
    if reference is not None:
        checks["reference finished"] = (reference.exit_code == 0, f"exit code {reference.exit_code} (log: {out / 'reference.log'})")
        mine, theirs = Path(chaos.folder) / weights, Path(reference.folder) / weights  # type: ignore[operator]
        if mine.exists() and theirs.exists():
            diff = _differences(_load_weights(mine), _load_weights(theirs))
            checks["weights equal"] = (not diff, "bit for bit" if not diff else "; ".join(diff[:5]))
        else:
            checks["weights equal"] = (False, f"missing: {[str(p) for p in (mine, theirs) if not p.exists()]}")
    checks["nothing left behind"] = (
        not chaos.leftover_processes and not chaos.leftover_files,
        f"processes {chaos.leftover_processes}, temporary files {chaos.leftover_files}",
    )
    summary = chaos.summary
    if summary is None:
        checks["ledger"] = (False, f"no goodput records in {Path(chaos.folder) / 'run'}")
        return report
    other = summary["shares"].get("other", 0.0)
    checks["time accounted"] = (other <= max_other, f"other {other:.2%} of all ranks' time (at most {max_other:.0%})")
    expected = 1 + sum(1 for f in faults if f.kind in RESTARTING)
    attempts = len(summary["attempts"])
    checks["each fault's restart"] = (
        attempts == expected,
        f"{attempts} attempts for {expected - 1} restarting fault(s); restart cost per rank: "
        + ", ".join(f"{r['per_rank'].get('restart', 0.0):.1f} s" for r in summary["attempts"][1:]),
    )
    slow = [f for f in faults if f.kind == "slow" and f.steps >= 16 and f.seconds >= 0.05]
    if slow:
        named = {s["rank"] for s in summary["stragglers"]}
        wanted = {r for f in slow for r in f.ranks}
        checks["stragglers named"] = (wanted <= named, f"slowed {sorted(wanted)}, named {sorted(named)}")
    return report


__all__ = ["FAULT_KINDS", "ChaosReport", "make_schedule", "run_chaos", "schedule_json"]
