"""Elastic training inside Ray Train on the two-node test cluster: ``ScalingConfig(num_workers=(1, 2))`` with one worker
per node and ``FailureConfig(max_failures=3)``. The second node is removed (everything of it SIGKILLed): the run goes
on with 1 worker from Ray's latest checkpoint; a node is added back: Ray grows the worker group to 2
(``elastic_resize_monitor_interval_s=2``). The sample ledger finds every sample trained exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric_core.runtime.ledger import report
from tests.plugins.elastic_scenarios import progress, ray_scenario

pytestmark = [pytest.mark.multiprocess]

TIMEOUT = 420


@pytest.mark.timeout(TIMEOUT * 3)
def test_ray_train_shrinks_when_a_node_goes_and_grows_when_it_comes_back(ray_cluster, tmp_path: Path) -> None:
    result = ray_scenario(ray_cluster, tmp_path / "out", timeout=TIMEOUT)
    output = result.outputs["driver"]
    assert result.codes == {"driver": 0}, output[-6000:]
    assert json.loads(output.split("RESULT ", 1)[1].splitlines()[0])["checkpoint"], "Ray kept the run's checkpoints"

    starts = [(record["resumed"], record["world"]) for record in progress(result.run) if "resumed" in record]
    sizes = iter(world for _, world in starts)
    assert all(size in sizes for size in (2, 1, 2)), f"2 workers, then 1, then 2 again: {starts}"
    assert [step for step, _ in starts] == sorted(step for step, _ in starts), starts
    ledger = report(result.run / "ledger")
    assert ledger.ok, ledger.text()
    epochs = ledger.as_dict()["loaders"]["loader0"]["epochs"]
    assert [epochs[e]["trained"] for e in ("0", "1")] == [96, 96], ledger.text()
    print(f"\nRay elastic: node removed -> next step at 1 worker {result.shrink_s:.1f} s; node added -> step at 2 workers {result.grow_s:.1f} s")
