"""The topology object: one answer to "where does this process sit, along which axis" for every part of Fabric.

Pure checks of :class:`~fabric_core.strategies.Topology` and :class:`~fabric_core.strategies.Axis` first; then what
each strategy family publishes, in one process (single device, fault-tolerant replica groups, a strategy written
against the older contract) and in a real 4-process job, where the topology is held against the strategies' own
device meshes and against the samples each rank's sampler really gives it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import run_ranks

from fabric_core import Fabric
from fabric_core.strategies import (
    DATA_REPLICATE,
    DATA_SHARD,
    PIPELINE,
    TENSOR,
    Axis,
    SingleDeviceStrategy,
    Topology,
)

SCRIPTS = Path(__file__).parent / "scripts"


def _grid(*sizes_and_roles: tuple[str, int, str], rank: int, per_node: int | None = None) -> Topology:
    """A topology of the given axes (row-major over them) for global rank ``rank``."""
    world = 1
    for _, size, _ in sizes_and_roles:
        world *= size
    per_node = per_node or world
    coordinates, rest = [], rank
    for _, size, _ in reversed(sizes_and_roles):
        coordinates.insert(0, rest % size)
        rest //= size
    axes = [Axis(name, size, c, role) for (name, size, role), c in zip(sizes_and_roles, coordinates)]
    return Topology(world // per_node, per_node, rank // per_node, rank % per_node, tuple(axes))


def test_data_parallel_rank_reads_the_data_axes_only_outermost_first():
    layout = (("pipeline", 2, PIPELINE), ("replicate", 2, DATA_REPLICATE), ("shard", 2, DATA_SHARD), ("tp", 2, TENSOR))
    seen = {}
    for rank in range(16):
        topology = _grid(*layout, rank=rank, per_node=4)
        assert topology.world_size == 16 and topology.global_rank == rank
        assert topology.data_parallel_size == 4
        key = (topology.coordinate("replicate"), topology.coordinate("shard"))
        assert topology.data_parallel_rank == key[0] * 2 + key[1]
        seen.setdefault(topology.data_parallel_rank, set()).add((topology.coordinate("pipeline"), topology.coordinate("tp")))
    # each data-parallel share is held by exactly the 4 (pipeline, tensor) peers
    assert {share: len(peers) for share, peers in seen.items()} == {0: 4, 1: 4, 2: 4, 3: 4}


def test_groups_along_an_axis_are_the_ranks_that_differ_only_there():
    layout = (("dp", 2, DATA_SHARD), ("tp", 4, TENSOR))
    topology = _grid(*layout, rank=5)
    assert topology.groups_along("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.groups_along("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topology.ranks_along("dp") == [1, 5] and topology.ranks_along("tp") == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="No axis 'sp'"):
        topology.groups_along("sp")


def test_axes_that_do_not_make_the_world_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"dp=2 x tp=3 make 6 processes, but the job has 4"):
        Topology(1, 4, axes=(Axis("dp", 2, 0, DATA_SHARD), Axis("tp", 3, 0, TENSOR)))
    with pytest.raises(ValueError, match="coordinate 2 is not in 0..1"):
        Axis("dp", 2, 2)
    with pytest.raises(ValueError, match="role 'expert'"):
        Axis("dp", 2, 0, "expert")
    with pytest.raises(ValueError, match="must differ"):
        Topology(1, 4, axes=(Axis("dp", 2, 0), Axis("dp", 2, 0)))


def test_a_fault_tolerant_axis_lies_outside_the_world_and_decides_who_writes():
    inside = Axis("shard", 2, 0, DATA_SHARD)
    before_quorum = Topology(1, 2, axes=(Axis("replica_group", 3, 1, DATA_REPLICATE, fault_tolerant=True), inside))
    assert before_quorum.world_size == 2  # the 3 groups are 3 worlds of 2
    assert before_quorum.data_parallel_size == 6 and before_quorum.data_parallel_rank == 2
    assert not before_quorum.is_global_zero  # group 1, before any quorum: group 0 writes
    first_live = Axis("replica_group", 3, 1, DATA_REPLICATE, fault_tolerant=True, live_size=2, live_coordinate=0)
    assert Topology(1, 2, axes=(first_live, inside)).is_global_zero  # group 0 is down: group 1 leads the quorum
    healing = Axis("replica_group", 3, 0, DATA_REPLICATE, fault_tolerant=True, live_size=2, live_coordinate=None)
    assert not Topology(1, 2, axes=(healing, inside)).is_global_zero  # group 0 heals: it does not write
    assert Topology(1, 2, local_rank=1, axes=(first_live, Axis("shard", 2, 1, DATA_SHARD))).is_global_zero is False


def test_describe_and_as_dict_say_the_same_thing():
    topology = _grid(("dp", 2, DATA_SHARD), ("tp", 2, TENSOR), rank=3, per_node=2)
    assert topology.describe() == "2 node(s) x 2 process(es); dp=2 x tp=2 (this process: 1, 1)"
    values = topology.as_dict()
    assert values["global_rank"] == 3 and values["data_parallel_rank"] == 1 and values["data_parallel_size"] == 2
    assert [a["name"] for a in values["axes"]] == ["dp", "tp"]
    json.dumps(values)  # plain values, for reports and loggers


def test_one_process_has_no_axes_and_is_global_zero():
    fabric = Fabric(accelerator="cpu", devices=1)
    topology = fabric.topology
    assert topology.axes == () and topology.world_size == 1
    assert fabric.is_global_zero and fabric.strategy.distributed_sampler_kwargs is None
    assert isinstance(fabric.strategy, SingleDeviceStrategy)


def test_a_strategy_written_against_the_older_contract_gets_axes_from_its_data_parallel_answers():
    """A third-party strategy that overrides ``data_parallel_rank``/``data_parallel_size`` (and no axes) keeps
    meaning what it said: its data axis, and the rest of the world as a model axis."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    try:
        from tp_strategy import TensorParallelStrategy
    finally:
        sys.path.remove(str(SCRIPTS))
    strategy = TensorParallelStrategy()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    topology = fabric.topology
    assert [(a.name, a.size, a.role) for a in topology.axes] == [("data_parallel", 1, DATA_REPLICATE), ("model_parallel", 2, TENSOR)]
    assert topology.data_parallel_size == 1 and strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


@pytest.mark.multiprocess
def test_every_strategy_family_publishes_a_topology_that_matches_its_mesh_and_its_sampler(tmp_path: Path):
    for family in ("fabric_ddp", "fabric_fsdp"):
        pytest.importorskip(family, reason="needs fabric-ddp and fabric-fsdp (the XLA lane installs only fabric-core and fabric-xla)")
    run_ranks(SCRIPTS / "topology_job.py", str(tmp_path), world_size=4, timeout=240, tmp_path=tmp_path)
    records = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in range(4)]
    expected_axes = {
        "model_parallel": [("data_parallel", 2, DATA_SHARD), ("tensor_parallel", 2, TENSOR)],
        "fsdp_hybrid": [("replicate", 2, DATA_REPLICATE), ("shard", 2, DATA_SHARD)],
        "fsdp": [("shard", 4, DATA_SHARD)],
        "ddp": [("data_replicate", 4, DATA_REPLICATE)],
    }
    for index, (label, axes) in enumerate(expected_axes.items()):
        per_rank = [rank_records[index] for rank_records in records]
        assert all(r["strategy"] == label for r in per_rank)
        for rank, r in enumerate(per_rank):
            topology = r["topology"]
            assert [(a["name"], a["size"], a["role"]) for a in topology["axes"]] == axes, label
            assert topology["global_rank"] == rank and topology["world_size"] == 4
            assert r["is_global_zero"] is (rank == 0)
        # every rank derives the same groups, and its sampler gives it exactly its data-parallel share
        assert all(r["groups"] == per_rank[0]["groups"] for r in per_rank), label
        shares: dict[int, list[int]] = {}
        for r in per_rank:
            shares.setdefault(r["topology"]["data_parallel_rank"], []).append(tuple(r["samples"]))
        size = per_rank[0]["topology"]["data_parallel_size"]
        assert sorted(shares) == list(range(size)), label
        for peers in shares.values():
            assert len(set(peers)) == 1, f"{label}: processes of one data-parallel share got different samples"
        covered = sorted(x for peers in shares.values() for x in peers[0])
        assert covered == list(range(16)), f"{label}: the shares do not cover the dataset once"
    # model_parallel: tensor-parallel peers (same row) share data; the rows split it
    mp = [rank_records[0]["topology"] for rank_records in records]
    assert [t["data_parallel_rank"] for t in mp] == [0, 0, 1, 1]
    assert records[0][0]["groups"] == {"data_parallel": [[0, 2], [1, 3]], "tensor_parallel": [[0, 1], [2, 3]]}
    assert torch.distributed.is_available()
