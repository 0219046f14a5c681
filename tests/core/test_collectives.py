"""The reference's collectives API (``TorchCollective``, ``CollectibleGroup``) on 2 and 3 real processes (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import run_ranks

from fabric_core.collectives import Collective, SingleDeviceCollective, TorchCollective

SCRIPT = Path(__file__).parent / "scripts" / "collectives_job.py"


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
