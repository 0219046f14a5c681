"""``EMA.average_parameters()`` under sharding strategies, 2 real processes each (``scripts/ema_checks.py``), and,
in the same fsdp processes, two sharded-checkpoint behaviours of the reference.

FSDP2 keeps the root module's gathered weights after a forward until the next backward: the block must evaluate
with the averages whether or not a forward came before it, and leave the model computing exactly what it computed
before (the averages must not stay in the gathered copy, nor the trained weights be written only to the shards).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import read_json, run_ranks

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "ema_checks.py"


_RESULTS: dict[str, dict] = {}


def _job(strategy: str, tmp_path_factory) -> dict:
    """One 2-rank job per strategy (run once in this process); its result.json serves every test below."""
    if strategy not in _RESULTS:
        out = tmp_path_factory.mktemp(f"sharded_{strategy}")
        run_ranks(SCRIPT, str(out), strategy, world_size=2, tmp_path=out, timeout=300)
        _RESULTS[strategy] = read_json(out / "result.json")
    return _RESULTS[strategy]


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_average_parameters_evaluates_with_the_averages_and_restores_the_model(strategy: str, tmp_path_factory):
    r = _job(strategy, tmp_path_factory)
    assert r["strategy"] == {"fsdp": "FSDPStrategy", "model_parallel": "ModelParallelStrategy"}[strategy]
    for case in ("no_forward_before", "forward_before"):
        checks = r[case]
        assert checks["inside_vs_averages"] < 1e-6, (case, checks)  # the block's forward: one process with the averages
        assert checks["inside_differs_from_trained"] > 1e-3, (case, checks)  # (the averages are not the weights)
        assert checks["after_vs_trained"] < 1e-6, (case, checks)  # after it: one process with the trained weights
        assert checks["weights_restored"], (case, checks)
    assert r["forward_before"]["after_equals_before"] is True  # bit for bit what the model computed before the block
    assert r["update_after_forward"] < 1e-6
    assert r["next_step_vs_one_process"] < 1e-6


def test_sharded_checkpoint_load_without_state_and_load_raw_of_the_folder(tmp_path_factory):
    r = _job("fsdp", tmp_path_factory)  # model_parallel writes the same format
    words = "but a state with at least  a model instance to reload is required. Pass it in like so:"
    assert set(r["load_without_state"]) == {"None", "{}"}
    for state, message in r["load_without_state"].items():
        assert message.startswith(f"Got FSDPStrategy.load_checkpoint(..., state={state}) {words}"), message
        assert "fabric consolidate" in message
    assert r["load_raw_folder_differed_before"] and r["load_raw_folder_equal"]
