"""The goodput report of a run: every rank's time, over every attempt, split into categories, from the ledger's
records in the run folder (``goodput/attempt-AAA/rank-RRRRR.json``, written by :mod:`fabric_core.runtime.goodput`).

How a rank's time is split (in rank-seconds; shares are of the sum over ranks):

* what the rank's own record attributes (start-up, productive and redone steps, checkpoints, quorum, sections);
* ``waiting``: the part of its step time global rank 0 estimated it spent waiting for slower ranks (moved out of
  ``productive``/``redone``);
* ``restart``: for an attempt after the first, its start-up, plus the gap since the rank's previous attempt ended;
  for an attempt that failed, whatever of its time the record does not attribute (from its last step to its end:
  the failure, its detection and the job's teardown);
* ``other``: what is left of a successful attempt (the end of the script after its last step, teardown).

A killed rank's record is as old as its last write (every :data:`fabric_core.runtime.hang.FLUSH_S` seconds): the time
after it counts as ``restart``. The checkpoint-interval suggestion (Young 1974, Daly 2006) takes the measured
blocking time of a save and the run's failure rate. Only the standard library is imported (matplotlib, when
installed, for the picture).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fabric_core.runtime.goodput import CATEGORIES, FOLDER, Ledger, median

SUMMARY_FILE = "summary.json"
#: How long global rank 0 waits at its end for the other ranks' final records before it writes the summary.
FINAL_WAIT_S = 5.0


class GoodputReportError(ValueError):
    """The folder holds no goodput records (not a run folder, or the run wrote none)."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_attempts(run_dir: str | os.PathLike[str]) -> dict[int, dict[int, dict[str, Any]]]:
    """``{attempt: {rank: record}}`` of the run folder ``run_dir``."""
    folder = Path(run_dir) / FOLDER
    if not folder.is_dir():
        raise GoodputReportError(
            f"{str(run_dir)!r} has no {FOLDER}/ folder: give a run folder (`fabric.run_info.dir`; by default"
            " <loggers' root>/runs/<run id>) of a run that wrote a goodput ledger."
        )
    attempts: dict[int, dict[int, dict[str, Any]]] = {}
    for entry in sorted(folder.glob("attempt-*")):
        try:
            number = int(entry.name.split("-", 1)[1])
        except ValueError:
            continue
        ranks = {}
        for path in entry.glob("rank-*.json"):
            record = _read(path)
            if record is not None:
                ranks[int(record.get("rank", path.stem.split("-")[1]))] = record
        if ranks:
            attempts[number] = ranks
    if not attempts:
        raise GoodputReportError(f"{str(folder)!r} holds no rank records yet.")
    return attempts


def young_daly(save_seconds: float, mtbf_seconds: float) -> dict[str, float]:
    """The checkpoint interval that loses the least time for a save cost ``C`` and a mean time between failures
    ``M``: Young's ``sqrt(2CM)`` and Daly's higher-order one (``M`` when ``C >= 2M``), with the share of time each
    loses to saving and to recomputing (``C/τ + τ/(2M)``)."""
    c, m = float(save_seconds), float(mtbf_seconds)
    if c <= 0 or m <= 0:
        raise ValueError(f"save cost and MTBF must be positive, got {c} and {m}.")
    young = math.sqrt(2 * c * m)
    if c < 2 * m:
        ratio = c / (2 * m)
        daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c
    else:
        daly = m
    return {"young_s": young, "daly_s": daly, "waste_share": c / daly + daly / (2 * m)}


def summarize(run_dir: str | os.PathLike[str], *, mtbf_s: float | None = None) -> dict[str, Any]:
    """The report of the run in ``run_dir`` as a dict (what ``summary.json`` holds and ``fabric goodput`` prints).

    ``mtbf_s``: a mean time between failures to suggest the checkpoint interval with, when the run itself saw none
    (or to override what it saw)."""
    attempts = load_attempts(run_dir)
    numbers = sorted(attempts)
    last = numbers[-1]
    totals: dict[str, float] = defaultdict(float)
    rows = []
    previous_end: dict[int, int] = {}
    previous_attempt_end: int | None = None
    stragglers: list[dict[str, Any]] = []
    saves: list[float] = []
    save_steps: list[int] = []
    step_times: list[float] = []
    failures = 0
    for number in numbers:
        ranks = attempts[number]
        start = min(r["process_start_ns"] for r in ranks.values())
        end = max(r["updated_ns"] for r in ranks.values())
        ended = all(r.get("ended") for r in ranks.values())
        failed = number != last or not ended
        failures += number != last
        zero = ranks.get(0, {})
        waiting = {int(k): float(v) for k, v in (zero.get("waiting_by_rank") or {}).items()}
        stragglers += [{**s, "attempt": number} for s in zero.get("stragglers") or []]
        for save in zero.get("saves") or []:
            saves.append(float(save["seconds"]))
            save_steps.append(int(save["step"]))
        if zero.get("step_time_median"):
            step_times.append(float(zero["step_time_median"]))
        attempt_totals: dict[str, float] = defaultdict(float)
        for rank, record in ranks.items():
            seconds = defaultdict(float, {k: float(v) for k, v in (record.get("seconds") or {}).items()})
            waited = min(waiting.get(rank, 0.0), seconds["productive"] + seconds["redone"])
            from_productive = min(waited, seconds["productive"])
            seconds["productive"] -= from_productive
            seconds["redone"] -= waited - from_productive
            seconds["waiting"] += waited
            if number != numbers[0]:
                seconds["restart"] += seconds.pop("startup", 0.0)
            span = (record["updated_ns"] - record["process_start_ns"]) / 1e9
            if record.get("first_step_ns") is None:  # no step completed: the whole process was start-up
                seconds["restart" if number != numbers[0] else "startup"] += max(0.0, span - sum(seconds.values()))
            rest = max(0.0, span - sum(seconds.values()))
            seconds["restart" if failed else "other"] += rest
            gap_from = previous_end.get(rank, previous_attempt_end)
            if gap_from is not None:
                seconds["restart"] += max(0.0, (record["process_start_ns"] - gap_from) / 1e9)
            previous_end[rank] = record["updated_ns"]
            for key, value in seconds.items():
                attempt_totals[key] += value
        previous_attempt_end = end
        for key, value in attempt_totals.items():
            totals[key] += value
        world = max(r.get("world_size", len(ranks)) for r in ranks.values())
        rows.append(
            {
                "attempt": number,
                "job": zero.get("job"),
                "restart": zero.get("restart"),
                "ranks": len(ranks),
                "world_size": world,
                "start_ns": start,
                "seconds": (end - start) / 1e9,
                "outcome": "failed" if failed else "finished",
                "resumed_from_step": zero.get("resumed_from"),
                "last_step": max(int(r.get("global_step", 0)) for r in ranks.values()),
                "per_rank": {k: v / max(1, len(ranks)) for k, v in attempt_totals.items()},
            }
        )
    total = sum(totals.values())
    first_start = min(r["process_start_ns"] for r in attempts[numbers[0]].values())
    wall = (max(r["updated_ns"] for r in attempts[last].values()) - first_start) / 1e9
    order = [c for c in CATEGORIES if c in totals or c in ("productive", "other")]
    order += sorted(k for k in totals if k not in CATEGORIES)
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "wall_s": wall,
        "rank_seconds": total,
        "categories": order,
        "seconds": {k: totals.get(k, 0.0) for k in order},
        "shares": {k: (totals.get(k, 0.0) / total if total else 0.0) for k in order},
        "goodput": totals.get("productive", 0.0) / total if total else 0.0,
        "attempts": rows,
        "failures": failures,
        "stragglers": stragglers,
        "steps": rows[-1]["last_step"],
        "step_time_median_s": median(step_times),
        "save_seconds_median": median(saves),
        "saves": len(saves),
        "generated_ns": time.time_ns(),
    }
    summary["checkpoint_interval"] = _suggest_interval(summary, save_steps, wall, failures, mtbf_s)
    return summary


def _suggest_interval(
    summary: dict[str, Any], save_steps: list[int], wall: float, failures: int, mtbf_s: float | None
) -> dict[str, Any]:
    cost = summary["save_seconds_median"]
    if mtbf_s is None and failures:
        mtbf_s = wall / failures
    suggestion: dict[str, Any] = {"save_seconds": cost, "mtbf_s": mtbf_s, "mtbf_from": "run" if failures else None}
    gaps = sorted(b - a for a, b in zip(save_steps, save_steps[1:]) if b > a)
    suggestion["current_interval_steps"] = median(gaps)
    if not cost or not mtbf_s:
        suggestion["note"] = (
            "no save measured" if not cost else "no failure in this run: give an expected MTBF (fabric goodput --mtbf)"
        )
        return suggestion
    suggestion.update(young_daly(cost, mtbf_s))
    step = summary["step_time_median_s"]
    if step:
        suggestion["daly_steps"] = max(1, round(suggestion["daly_s"] / step))
    return suggestion


def format_table(summary: dict[str, Any]) -> str:
    """The report as text: the split of the run's time, the attempts, stragglers, the checkpoint interval."""
    lines = [
        f"Run folder: {summary['run_dir']}",
        f"Wall time {summary['wall_s']:.1f} s, {len(summary['attempts'])} attempt(s), {summary['failures']} failure(s),"
        f" {summary['steps']} steps; goodput {summary['goodput']:.1%} (productive share of all ranks' time)",
        "",
        f"{'category':<14}{'rank-seconds':>14}{'share':>9}",
    ]
    for name in summary["categories"]:
        lines.append(f"{name:<14}{summary['seconds'][name]:>14.2f}{summary['shares'][name]:>9.2%}")
    lines += ["", "attempt  outcome   ranks  seconds  resumed-at  last-step  restart s/rank  redone s/rank"]
    for row in summary["attempts"]:
        per = row["per_rank"]
        resumed = "-" if row["resumed_from_step"] is None else str(row["resumed_from_step"])
        lines.append(
            f"{row['attempt']:>7}  {row['outcome']:<8}  {row['ranks']:>5}  {row['seconds']:>7.1f}  {resumed:>10}"
            f"  {row['last_step']:>9}  {per.get('restart', 0.0):>14.2f}  {per.get('redone', 0.0):>13.2f}"
        )
    if summary["stragglers"]:
        lines.append("")
        for s in summary["stragglers"]:
            lines.append(
                f"straggler: rank {s['rank']} ({s.get('host', '?')}) {s['slower_s'] * 1000:.0f} ms/step slower"
                f" ({s['slower_share']:.0%} of a step) since step {s['since_step']} (attempt {s['attempt']})"
            )
    interval = summary["checkpoint_interval"]
    lines.append("")
    if "daly_s" in interval:
        steps = f" = {interval['daly_steps']} steps" if "daly_steps" in interval else ""
        current = interval.get("current_interval_steps")
        lines.append(
            f"checkpoint interval (Young/Daly): save {interval['save_seconds']:.2f} s, MTBF {interval['mtbf_s']:.0f} s"
            f" ({'measured' if interval['mtbf_from'] else 'given'}) -> every {interval['daly_s']:.1f} s{steps}"
            f" (Young {interval['young_s']:.1f} s), expected loss {interval['waste_share']:.1%}"
            + (f"; now every {current:g} steps" if current else "")
        )
    else:
        lines.append(f"checkpoint interval: {interval.get('note')}")
    return "\n".join(lines) + "\n"


def draw(summary: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """The time split as a PNG: one bar per attempt (seconds per rank, stacked by category) and the run's shares."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("Drawing the goodput picture needs matplotlib: `pip install matplotlib`.") from None
    categories = summary["categories"]
    colours = dict(zip(CATEGORIES, ("#7f7f7f", "#2ca02c", "#ff7f0e", "#1f77b4", "#d62728", "#9467bd", "#8c564b", "#c7c7c7")))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    rows = summary["attempts"]
    bottoms = [0.0] * len(rows)
    for name in categories:
        values = [row["per_rank"].get(name, 0.0) for row in rows]
        left.bar([str(r["attempt"]) for r in rows], values, bottom=bottoms, label=name, color=colours.get(name))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    left.set_xlabel("attempt")
    left.set_ylabel("seconds per rank")
    left.set_title(f"where the time went (goodput {summary['goodput']:.1%})")
    left.legend(fontsize=8, loc="upper right")
    shares = [(n, summary["shares"][n]) for n in categories if summary["shares"][n] > 0]
    right.pie([s for _, s in shares], labels=[f"{n} {s:.0%}" for n, s in shares], colors=[colours.get(n) for n, _ in shares], textprops={"fontsize": 8})
    right.set_title("shares of all ranks' time")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)


def write_summary_at_end(ledger: Ledger) -> None:
    """Global rank 0 at the end of its process: wait briefly for the other ranks' final records, then write
    ``goodput/summary.json``. Never raises."""
    info = ledger.info
    if info is None:
        return
    folder = info.dir / FOLDER / f"attempt-{info.attempt:03d}"
    deadline = time.monotonic() + FINAL_WAIT_S
    while time.monotonic() < deadline:
        records = [_read(p) for p in folder.glob("rank-*.json")]
        if len(records) >= ledger.world_size and all(r and r.get("ended") for r in records):
            break
        time.sleep(0.05)
    summary = summary_or_none(info.dir)
    if summary is None:
        return
    try:
        target = info.dir / FOLDER / SUMMARY_FILE
        tmp = target.with_name(f".{SUMMARY_FILE}.tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, target)
    except (OSError, TypeError, ValueError):  # a full or read-only disk: the records stay, `fabric goodput` reads them
        pass


def summary_or_none(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """:func:`summarize`, or ``None`` where the ledger cannot be summarised: for callers to whom a report is a
    courtesy (the end of a run, the chaos harness), never a reason to fail."""
    try:
        return summarize(run_dir)
    except Exception:  # a ledger cut short by a crash may fail the arithmetic anywhere: no summary, the caller goes on
        return None


def metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The shares as logger metrics: ``goodput/<category>_share`` and ``goodput/goodput``."""
    values = {f"goodput/{name}_share": share for name, share in summary["shares"].items()}
    values["goodput/goodput"] = summary["goodput"]
    return values


__all__ = ["GoodputReportError", "draw", "format_table", "load_attempts", "metrics", "summarize", "summary_or_none", "young_daly"]
