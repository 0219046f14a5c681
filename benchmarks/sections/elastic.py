"""Elastic training: seconds from a failure to the next step at the new size, for each way a world changes size.

The scenarios are the tests' (``tests/plugins/elastic_scenarios.py``, the loop of ``tests/plugins/scripts/
elastic_train.py``: a 96-sample MLP run, ddp, one process per node, a checkpoint every 2 steps), timed here:

* ``restart``: a job restarted by its user or scheduler: 4 ranks SIGKILLed, 2 started at once (process start,
  ``Fabric()``, rendezvous, ``latest_checkpoint`` + ``load`` of the global position);
* ``fabric run``: ``--num-nodes 1:2`` agents on loopback, the second node SIGKILLed with its worker (torchrun notices
  the failure, drops the node after its missed heartbeats, waits ``last_call``, restarts the survivor);
* ``ray``: ``TorchTrainer`` with ``num_workers=(1, 2)`` on the two-node test cluster, the second node removed (Ray
  notices the dead worker, restarts the group on what is left).

Each also reports the time from a node joining to the first step at the larger size (not for ``restart``). No bound:
the issue asked for the numbers. Tiny mode times ``restart`` only (the others take minutes each).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT, module_available, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section

PATHS = {"restart": "restart on 2 ranks", "agents": "`fabric run --num-nodes 1:2`", "ray": "Ray Train `num_workers=(1, 2)`"}


def unavailable() -> str | None:
    for module in ("fabric_ddp", "torchdata"):
        if not module_available(module):
            return f"`{module}` is not importable: install fabric-ddp and torchdata (`make setup`)"
    return None


def _scenario(path: str, work: Path) -> Any:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests.plugins import elastic_scenarios

    if path == "restart":
        return elastic_scenarios.restart_scenario(work)
    if path == "agents":
        return elastic_scenarios.agents_scenario(work)
    from tests.plugins.ray.conftest import running_cluster

    logs = work / "cluster-logs"
    logs.mkdir()
    with running_cluster(logs) as cluster:
        return elastic_scenarios.ray_scenario(cluster, work / "out")


def run(ctx: RunContext) -> dict[str, Any]:
    cfg = dict(ctx.config)
    paths = [p for p in cfg["paths"] if p != "ray" or module_available("fabric_ray")]
    shrink: dict[str, list[float]] = {p: [] for p in paths}
    grow: dict[str, list[float]] = {p: [] for p in paths if p != "restart"}
    with tempfile.TemporaryDirectory(prefix="fabric-elastic-bench-") as tmp:
        for rep in range(cfg["reps"]):
            for path in paths:
                work = Path(tmp) / f"{path}-{rep}"
                work.mkdir()
                result = _scenario(path, work)
                bad = {name: code for name, code in result.codes.items() if code != 0}
                if bad:
                    raise RuntimeError(f"{path}: exit codes {bad}:\n" + "\n".join(o[-2000:] for o in result.outputs.values()))
                shrink[path].append(result.shrink_s)
                if path in grow:
                    grow[path].append(result.grow_s)
                ctx.log(f"  elastic {path} rep {rep}: failure -> step {result.shrink_s:.1f} s, join -> step {result.grow_s:.1f} s")
    return {
        "config": cfg,
        "failure_to_step_s": {p: summarize(v) for p, v in shrink.items()},
        "join_to_step_s": {p: summarize(v) for p, v in grow.items()},
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    lines = [
        "### Elastic: seconds from a failure to the next step at the new size",
        "",
        "The tests' scenarios (`tests/plugins/elastic_scenarios.py`), one process per node, ddp, gloo, CPU; a checkpoint"
        f" every 2 steps; {cfg['reps']} repetition(s). *restart*: 4 ranks SIGKILLed, 2 started at once by the user or"
        " a scheduler. *fabric run*: two `--num-nodes 1:2` agents on loopback (`keep_alive_interval=2`,"
        " `keep_alive_max_attempt=5`, `last_call_timeout=3`), the second node SIGKILLed with its worker; then a new"
        " agent. *Ray*: two Ray nodes, one worker each (`resources_per_worker={'CPU': 2}`), the second node"
        " SIGKILLed; then a new node (`elastic_resize_monitor_interval_s=2`). No bound.",
        "",
    ]
    rows = []
    for path, label in PATHS.items():
        if path not in result["failure_to_step_s"]:
            continue
        join = result["join_to_step_s"].get(path)
        rows.append([label, stat(result["failure_to_step_s"][path]), stat(join) if join else "-"])
    lines += table(["launch path", "failure -> next step, smaller (s)", "join -> next step, larger (s)"], rows)
    return "\n".join(lines) + "\n"


SECTION = Section(
    name="elastic",
    order=97,
    modes={
        "full": {"reps": 2, "paths": ["restart", "agents", "ray"]},
        "quick": {"reps": 1, "paths": ["restart", "agents", "ray"]},
        "tiny": {"reps": 1, "paths": ["restart"]},
    },
    run=run,
    render=render,
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=3600,
)
