"""The reference's collectives API (``TorchCollective``, ``CollectibleGroup``) on 2 and 3 real processes (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import run_ranks

from fabric_core.collectives import Collective, SingleDeviceCollective, TorchCollective

SCRIPT = Path(__file__).parent / "scripts" / "collectives_job.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_groups_point_to_point_and_the_decoupled_pattern(tmp_path, world):
    pytest.importorskip("fabric_ddp", reason="the trainers train with fabric-ddp (not installed in the XLA lane)")
    run_ranks(SCRIPT, str(tmp_path), world_size=world, timeout=240, tmp_path=tmp_path)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, s in enumerate(seen):
        assert (s["rank"], s["size"]) == (rank, world)
        assert s["all_reduce"] == sum(range(1, world + 1)) and s["all_reduce_max"] == world - 1
        assert s["broadcast_from_last"] == world - 1
        assert s["all_gather"] == [r * 10.0 for r in range(world)]
        assert s["scatter"] == rank * 2.0 and s["scatter_object"] == f"item{rank}"
        assert s["all_gather_object"] == list(range(world))
        inside = rank in (0, 1)
        assert (s["pair_rank"], s["pair_size"]) == ((rank, 2) if inside else (-1, -1))
        if inside:
            assert s["pair_broadcast"] == 6.0 and s["pair_sum"] == 2.0
        assert s["role"] == ("player" if rank == 0 else "trainer")
        after = json.loads((tmp_path / f"rank{rank}.after.json").read_text())
        assert after == {"groups_destroyed": 1 if inside else 0, "owns_group": False}
    assert seen[0]["reduce_at_0"] == world and seen[0]["gather_at_0"] == [100.0 + r for r in range(world)]
    assert seen[0]["answers"] == [10.0 * p for p in range(1, world)]
    # the trainers (ranks 1..N-1) trained on their parts of the player's data with DDP over their own group, and
    # trainer 1 sent weights equal to one step on all of it back to the player
    assert seen[0]["weights_match"] and "loss" in seen[0]["metrics"]


def test_a_collective_without_a_group_says_how_to_get_one():
    with pytest.raises(RuntimeError, match=r"does not own a group yet. Create one first: `collective.create_group\(\)`"):
        SingleDeviceCollective().group  # noqa: B018
    with pytest.raises(RuntimeError, match="does not own a group to destroy"):
        SingleDeviceCollective().teardown()
    one = SingleDeviceCollective().create_group()
    with pytest.raises(RuntimeError, match="already owns a group"):
        one.create_group()


def test_torch_collective_before_setup_says_to_set_up():
    with pytest.raises(RuntimeError, match=r"Call `TorchCollective\(\).setup\(backend='gloo'\)`"):
        TorchCollective().rank  # noqa: B018
    with pytest.raises(RuntimeError, match="A new process group needs the default group"):
        TorchCollective.new_group(ranks=[0])


def test_reduction_names_are_checked():
    assert TorchCollective._convert_to_native_op("sum") == torch.distributed.ReduceOp.SUM
    assert TorchCollective._convert_to_native_op("Max") == torch.distributed.ReduceOp.MAX
    with pytest.raises(ValueError, match="'mean' is not a member of `ReduceOp`: use one of 'sum'"):
        TorchCollective._convert_to_native_op("mean")
    with pytest.raises(ValueError, match="Unsupported op 3"):
        TorchCollective._convert_to_native_op(3)


def test_single_device_collective_is_the_identity():
    c = SingleDeviceCollective().setup()
    t = torch.tensor([1.0])
    assert c.all_reduce(t) is t and c.broadcast(t, src=0) is t and c.all_gather([], t) == [t]
    assert (c.rank, c.world_size) == (0, 1) and isinstance(c, Collective)
    assert c.create_group().group.size() == 1


REFERENCE_SCRIPT = Path(__file__).parent / "scripts" / "collectives_reference_job.py"


@pytest.mark.multiprocess
def test_reduce_scatter_all_to_all_gather_object_and_monitored_barrier_equal_torch_distributed(tmp_path):
    """The four documented collectives the job above does not use, on 2 processes, each beside torch.distributed's
    own call on the same inputs: the same results (every reduction op, gather_object to rank 0 and to rank 1), the
    caller's output tensors filled and returned, and a monitored barrier that names the late rank within its
    timeout with torch's own error."""
    run_ranks(REFERENCE_SCRIPT, str(tmp_path), world_size=2, timeout=120, tmp_path=tmp_path)
    seen = [json.loads((tmp_path / f"reference{r}.json").read_text()) for r in range(2)]
    # make test's torch has them all on gloo; on an older torch (the XLA lane's) ours must fail as torch's own does
    has_all = torch.__version__ >= "2.13"
    for rank, s in enumerate(seen):
        for op in ("sum", "max", "min", "product"):
            case = s[f"reduce_scatter_{op}"]
            assert case["ours"] == case["torch"], (rank, op, case)
            assert case["filled"] or not has_all, (rank, op, case)
        a2a = s["all_to_all"]
        assert a2a["ours"] == a2a["torch"], (rank, a2a)
        assert a2a["filled"] or not has_all, (rank, a2a)
        if s["reduce_scatter_sum"]["filled"]:  # element k of every rank's input for this rank, reduced
            rows = [[(r * 100.0 + rank * 10.0 + k) ** 1.5 for k in range(3)] for r in range(2)]
            assert s["reduce_scatter_sum"]["ours"] == pytest.approx([a + b for a, b in zip(*rows)], rel=1e-6)
            assert s["reduce_scatter_max"]["ours"] == pytest.approx([max(a, b) for a, b in zip(*rows)], rel=1e-6)
        if a2a["filled"]:
            for r in range(2):  # row r came from rank r's input for this rank
                assert a2a["ours"][r] == pytest.approx([(r * 100.0 + rank * 10.0 + k) ** 1.5 for k in range(3)])
        for dst in (0, 1):
            case = s[f"gather_object_{dst}"]
            assert case["ours"] == case["torch"], (rank, dst, case)
            if rank == dst:
                assert case["ours"] == [{"rank": r, "payload": [r] * (r + 1), "name": f"r{r}"} for r in range(2)]
            else:
                assert case["ours"] is None
        assert s["monitored_all_arrive"] == {"ours": None, "torch": None}
        after = json.loads((tmp_path / f"reference{rank}.after.json").read_text())
        assert after == {"default_group_destroyed": True}
    late = {who: seen[0][f"monitored_late_{who}"] for who in ("ours", "torch")}
    for who, case in late.items():
        assert case["error"] is not None and "Rank 1 failed to pass monitoredBarrier" in case["error"], (who, case)
        assert case["seconds"] < 2.4, (who, case)  # ended by its own timeout, not by rank 1 arriving
    assert seen[0]["monitored_same_error"], late


@pytest.mark.multiprocess
def test_a_process_can_launch_again_after_a_teardown(tmp_path: Path):
    """A second (and third) ``launch()`` in the same 4 processes, with the first group's device mesh still alive,
    meets and computes: torch's own rendezvous would start a new store on the same port while the other ranks still
    reach the old one (they failed with "Connection was likely closed" and rank 0 waited for ever)."""
    run_ranks(Path(__file__).parent / "scripts" / "relaunch_job.py", str(tmp_path), world_size=4, timeout=180, tmp_path=tmp_path)
    for rank in range(4):
        assert (tmp_path / f"rank{rank}.txt").read_text().split("\n")[:3] == ["0 6", "1 10", "2 14"]
