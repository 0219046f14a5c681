"""``fabric run --num-nodes 1:2``: torchrun's elastic agents with a c10d rendezvous, two of them on loopback. The node
that does not host the rendezvous store is SIGKILLed (agent and worker); training goes on at 1 rank from the last
checkpoint; a new agent joins and it grows back to 2 ranks; the sample ledger finds every sample trained exactly
once. The scenario itself is in ``tests/plugins/elastic_scenarios.py`` (the ``elastic`` benchmark times it too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fabric_core.runtime.ledger import report
from tests.plugins.elastic_scenarios import agents_scenario, progress

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="uses /proc"),
    pytest.mark.skipif(importlib.util.find_spec("torchdata") is None, reason="needs torchdata's StatefulDataLoader"),
]


@pytest.mark.timeout(900)
def test_an_elastic_job_shrinks_when_a_node_dies_and_grows_when_one_joins(tmp_path: Path):
    # multiprocess-check: starts ranks (`fabric run --num-nodes 1:2` agents, in elastic_scenarios.agents_scenario)
    result = agents_scenario(tmp_path)
    assert result.codes == {"a": 0, "c": 0}, {name: out[-3000:] for name, out in result.outputs.items()}
    assert "RUN slow done world=2" in result.outputs["a"] + result.outputs["c"]

    # every attempt started at its size from the checkpoint before (2 ranks, then 1, then 2 again)
    starts = [(record["resumed"], record["world"]) for record in progress(result.run) if "resumed" in record]
    sizes = iter(world for _, world in starts)
    assert all(size in sizes for size in (2, 1, 2)), f"2 ranks, then 1, then 2 again: {starts}"
    assert starts[-1][1] == 2
    steps = [step for step, _ in starts]
    assert steps == sorted(steps) and steps[-1] > 0, f"each attempt resumed from a later checkpoint: {starts}"

    ledger = report(result.run / "ledger")
    assert ledger.ok, ledger.text()
    epochs = ledger.as_dict()["loaders"]["loader0"]["epochs"]
    assert [epochs[e]["trained"] for e in ("0", "1")] == [96, 96], ledger.text()
    assert ledger.rolled_back > 0 or len(ledger.resumes["loader0"]) >= 2, ledger.text()
    print(f"\nelastic agents: failure -> next step at 1 rank {result.shrink_s:.1f} s; join -> step at 2 ranks {result.grow_s:.1f} s")
