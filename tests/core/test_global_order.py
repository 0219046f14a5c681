"""The global sample order (``fabric_core.utilities.global_order``) and the loader position that resumes it on another
number of ranks, in one process: each rank's sampler and ``FabricDataLoader`` are built as ``setup_dataloaders``
builds them on that rank, and the state rank 0 saves is loaded into every rank of the next world (as ``fabric.load``
does). The real multi-process runs are in tests/plugins/test_elastic_resize.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

from fabric_core import Fabric
from fabric_core.utilities.data import global_order_sampler_for, reinstantiate_dataloader
from fabric_core.utilities.global_order import GlobalOrderSampler, last_step_length
from fabric_core.wrappers import FabricDataLoader

DATA = TensorDataset(torch.arange(50))


def _ranks(loader_factory, world: int, global_batch_size: int | None = None) -> list[FabricDataLoader]:
    """What ``setup_dataloaders`` makes of the user's loader on each rank of a ``world``-rank data-parallel job."""
    loaders = []
    for rank in range(world):
        loader = loader_factory()
        sampler = global_order_sampler_for(loader, num_replicas=world, rank=rank, seed=3, global_batch_size=global_batch_size)
        assert isinstance(sampler, GlobalOrderSampler)
        share = sampler.share_size() if global_batch_size is not None else None
        loaders.append(FabricDataLoader(reinstantiate_dataloader(loader, sampler, batch_size=share)))
    return loaders


def _train(loaders: list[FabricDataLoader], steps: int | None, seen: Counter) -> dict:
    """``steps`` batches on every rank (None: to the epoch's end); returns rank 0's state, as fabric.save keeps it."""
    iterators = [iter(loader) for loader in loaders]
    taken = 0
    while steps is None or taken < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "every rank has as many batches"
        for batch in batches:
            seen.update(batch[0].tolist())
        taken += 1
    return loaders[0].state_dict()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("size", "world", "batch"), [(50, 4, 3), (50, 3, 4), (48, 2, 5), (7, 4, 1)])
def test_an_unresized_run_gets_exactly_the_batches_of_distributed_sampler(size, world, batch, shuffle):
    for rank in range(world):
        expected = list(DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=3))
        sampler = GlobalOrderSampler(range(size), world, rank, shuffle=shuffle, seed=3, batch_size=batch)
        assert list(sampler) == expected and len(sampler) == len(expected)


@pytest.mark.parametrize("global_batch_size", [None, 12, 10])
@pytest.mark.parametrize("worlds", [(4, 2, 3), (3, 1, 4), (2, 4, 1)])
def test_a_run_resized_twice_mid_epoch_trains_every_sample_once(worlds, global_batch_size):
    """The per-rank batch kept (None) or a fixed global batch (10 does not divide by 3 or 4: shares differ by one)."""
    factory = lambda: DataLoader(DATA, batch_size=3, shuffle=True)  # noqa: E731
    seen: Counter = Counter()
    state = None
    for world, steps in zip(worlds, (2, 1, None)):
        loaders = _ranks(factory, world, global_batch_size)
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        state = _train(loaders, steps, seen)
    # the only repeats are pads of the last global batch (fewer than a world's worth)
    repeated = sum(n - 1 for n in seen.values())
    assert set(seen) == set(range(50)), "nothing lost"
    assert repeated < worlds[-1], f"{repeated} repeats; only the last batch's pads may repeat"
    assert state == {**state, "fabric_epoch": 1, "fabric_mid_epoch": False, "fabric_position": 0}


def test_a_fixed_global_batch_that_does_not_divide_gives_shares_one_apart_and_weights_that_restore_the_mean():
    loaders = _ranks(lambda: DataLoader(DATA, batch_size=3), world=4, global_batch_size=10)
    assert [loader.batch_size for loader in loaders] == [3, 3, 2, 2]
    assert [loader.global_batch_size for loader in loaders] == [10] * 4
    weights = [loader.share_weight for loader in loaders]
    assert weights == [1.2, 1.2, 0.8, 0.8]
    batches = [list(loader) for loader in loaders]
    assert len({len(b) for b in batches}) == 1, "every rank steps as often"
    # the mean over ranks of (weight x rank's mean) is the mean over the global batch
    first = [b[0][0].double() for b in batches]
    assert torch.isclose(sum(w * t.mean() for w, t in zip(weights, first)) / 4, torch.cat(first).mean())


def test_drop_last_drops_an_incomplete_last_global_batch_on_every_rank():
    loaders = _ranks(lambda: DataLoader(DATA, batch_size=4, drop_last=True), world=3)
    counts = [len(list(loader)) for loader in loaders]
    assert counts == [4, 4, 4], "50 samples, global batch 12: 4 full steps, the last 2 samples dropped everywhere"
    assert last_step_length(2, 12, 3) == 3 and last_step_length(11, 10, 4) == 11


def test_a_wrapped_sampler_is_ordered_alike_on_every_rank_and_resumes_at_its_position():
    weights = torch.rand(50)

    def factory():
        return DataLoader(DATA, batch_size=2, sampler=WeightedRandomSampler(weights, 50))

    seen_first: Counter = Counter()
    state = _train(_ranks(factory, 2), 5, seen_first)
    assert state["fabric_position"] == 20
    whole: Counter = Counter()
    _train(_ranks(factory, 2), None, whole)
    rest: Counter = Counter()
    loaders = _ranks(factory, 5)
    for loader in loaders:
        loader.load_state_dict(state)
    _train(loaders, None, rest)
    assert seen_first + rest == whole, "resumed on 5 ranks, the rest of the same order"


def test_a_stateful_loader_with_workers_resumes_from_the_global_position_not_its_own_count():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def factory():
        return stateful.StatefulDataLoader(DATA, batch_size=2, shuffle=True, num_workers=2)

    first: Counter = Counter()
    loaders = _ranks(factory, 4)
    state = _train(loaders, 3, first)
    saved = loaders[0].checkpoint_state()  # what fabric.save writes: torchdata's layout under the key, ours apart
    assert saved[1]["fabric_position"] == 24 and "_snapshot" in saved[0]
    rest: Counter = Counter()
    resumed = _ranks(factory, 2)
    for loader in resumed:
        loader.load_checkpoint_state(*saved)
    _train(resumed, None, rest)
    assert set(first) | set(rest) == set(range(50)) and not set(first) & set(rest)
    assert state["fabric_order"] == {"size": 50, "seed": 3, "shuffle": False}  # torchdata's sampler: wrapped, its own shuffle


def test_a_position_from_another_dataset_is_refused():
    loader = _ranks(lambda: DataLoader(DATA, batch_size=2), 2)[0]
    state = {"fabric_epoch": 0, "fabric_mid_epoch": True, "fabric_position": 10, "fabric_order": {"size": 40}}
    with pytest.raises(ValueError, match="epoch of 40 samples, but this loader's has 50"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="outside this epoch of 50 samples"):
        loader.load_state_dict({**state, "fabric_position": 51, "fabric_order": {}})


def test_bad_global_batch_sizes_are_refused_clearly():
    with pytest.raises(ValueError, match="smaller than the 4 data-parallel ranks"):
        global_order_sampler_for(DataLoader(DATA, batch_size=2), num_replicas=4, rank=0, global_batch_size=3)
    with pytest.raises(ValueError, match="must be a positive integer"):
        global_order_sampler_for(DataLoader(DATA, batch_size=2), num_replicas=1, rank=0, global_batch_size=0)
    with pytest.raises(ValueError, match="`batch_size=None`"):
        global_order_sampler_for(DataLoader(DATA, batch_size=None), num_replicas=1, rank=0, global_batch_size=4)
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="needs Fabric's distributed sampler"):
        fabric.setup_dataloaders(DataLoader(DATA, batch_size=2), use_distributed_sampler=False, global_batch_size=4)


def test_one_process_with_a_fixed_global_batch_takes_all_of_it_and_saves_its_position():
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(DataLoader(DATA, batch_size=2, shuffle=True), global_batch_size=8)
    iterator = iter(loader)
    assert len(next(iterator)[0]) == 8
    next(iterator)
    assert loader.state_dict()["fabric_position"] == 16


def test_shares_can_follow_a_changing_membership_batch_by_batch():
    """For fault-tolerant replica groups (issue 41): the shares of each global batch come from the members alive when
    it is drawn; with the per-rank batch kept every sample is still drawn once."""
    members = [2, 2, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3]  # live members per global batch: one leaves, two join

    def sampler(member: int) -> GlobalOrderSampler:
        counts = iter(members)

        def membership() -> tuple[int, int]:
            live = next(counts)
            return min(member, live - 1), live  # a member beyond the live ones would take no part: here it repeats

        return GlobalOrderSampler(range(30), 2, 0, seed=1, batch_size=2, membership=membership)

    steps = [list(sampler(member).steps()) for member in range(3)]
    covered: Counter = Counter()
    for k, live in enumerate(members[: len(steps[0])]):
        for member in range(live):
            step = steps[member][k]
            assert (step.share, step.shares) == (member, live) and step.end - step.start <= 2 * live
            covered.update(step.indices[: len(step.indices) - step.padding])
    assert set(covered) == set(range(30)) and max(covered.values()) == 1
