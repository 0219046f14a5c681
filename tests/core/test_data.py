from __future__ import annotations

import multiprocessing
import random

import pytest
import torch
from script_helpers import GlobalRngSampler
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from fabric_core.utilities.data import (
    DataLoaderRebuildError,
    DistributedSamplerWrapper,
    capture_init_arguments,
    distributed_sampler_for,
    needs_distributed_sampler,
    reinstantiate_dataloader,
    wrapped_sampler_seed,
)


def make_dataset(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n))


class ReversedSampler(Sampler):
    """Deterministic custom sampler; counts passes and records ``set_epoch`` calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.passes = 0
        self.epochs: list[int] = []

    def __iter__(self):
        self.passes += 1
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class EndlessSampler(Sampler):
    def __iter__(self):
        while True:
            yield 0


class InfiniteLenSampler(EndlessSampler):
    def __len__(self):
        return float("inf")


# ---------------------------------------------------------------------------------------------------------------------
# DistributedSamplerWrapper
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_wrapper_over_weighted_sampler_splits_indices_across_ranks(shuffle):
    def rank_indices(rank: int) -> list[int]:
        # The ranks' own generators differ on purpose: the wrapper draws the order from (seed, epoch) instead.
        weighted = WeightedRandomSampler(
            [1.0] * 10, num_samples=10, replacement=False, generator=torch.Generator().manual_seed(3 + rank)
        )
        return list(DistributedSamplerWrapper(weighted, num_replicas=2, rank=rank, shuffle=shuffle, seed=7))

    rank0, rank1 = rank_indices(0), rank_indices(1)
    assert len(rank0) == len(rank1) == 5
    assert set(rank0).isdisjoint(rank1)
    assert sorted(rank0 + rank1) == list(range(10))


def test_wrapper_without_shuffle_keeps_the_wrapped_order():
    rank0 = list(DistributedSamplerWrapper(ReversedSampler(6), num_replicas=2, rank=0, shuffle=False))
    rank1 = list(DistributedSamplerWrapper(ReversedSampler(6), num_replicas=2, rank=1, shuffle=False))
    assert rank0 == [5, 3, 1]
    assert rank1 == [4, 2, 0]


def test_wrapper_rematerialises_the_sampler_each_iteration():
    class Rotating(ReversedSampler):
        def __iter__(self):
            self.passes += 1
            return iter([(i + self.passes) % self.n for i in range(self.n)])

    wrapper = DistributedSamplerWrapper(Rotating(4), num_replicas=1, rank=0, shuffle=False)
    assert list(wrapper) == [1, 2, 3, 0]
    assert list(wrapper) == [2, 3, 0, 1]
    assert len(wrapper) == 4


def test_wrapper_set_epoch_forwards_and_changes_the_shuffle():
    sampler = ReversedSampler(20)
    wrapper = DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=True, seed=1)
    first = list(wrapper)
    wrapper.set_epoch(3)
    assert wrapper.epoch == 3
    assert sampler.epochs == [3]
    assert list(wrapper) != first
    assert wrapper.sampler is sampler


def test_wrapper_set_epoch_without_wrapped_set_epoch():
    wrapper = DistributedSamplerWrapper(SequentialSampler(range(4)), num_replicas=2, rank=1, shuffle=False)
    wrapper.set_epoch(2)
    assert wrapper.epoch == 2
    assert list(wrapper) == [1, 3]


def _shards(make_sampler, epochs=(0, 1), seed=0, world=2):
    """Per epoch, the indices each emulated rank gets; every rank first seeds its global RNGs differently."""
    result = []
    for epoch in epochs:
        per_rank = []
        for rank in range(world):
            torch.manual_seed(100 + rank)
            random.seed(200 + rank)
            wrapper = DistributedSamplerWrapper(make_sampler(), num_replicas=world, rank=rank, shuffle=False, seed=seed)
            wrapper.set_epoch(epoch)
            per_rank.append(list(wrapper))
        result.append(per_rank)
    return result


def _assert_partition(per_rank, n):
    flat = [i for indices in per_rank for i in indices]
    assert sorted(flat) == list(range(n)), per_rank  # every sample on exactly one rank


@pytest.mark.parametrize(
    "make_sampler",
    [
        pytest.param(lambda: RandomSampler(range(40)), id="RandomSampler-generator-None"),
        pytest.param(
            lambda: WeightedRandomSampler([1.0] * 40, 40, replacement=False), id="WeightedRandomSampler"
        ),
        pytest.param(lambda: GlobalRngSampler(40), id="no-generator-global-rng"),
    ],
)
def test_wrapped_random_sampler_is_the_same_order_on_every_rank(make_sampler):
    epoch0, epoch1 = _shards(make_sampler)
    _assert_partition(epoch0, 40)
    _assert_partition(epoch1, 40)
    assert epoch0 != epoch1  # a new order every epoch


def test_wrapped_torchdata_random_sampler_is_the_same_order_on_every_rank():
    """torchdata's RandomSampler is not torch's: it seeds its own generator from the global RNG when created."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="`make setup` installs torchdata")
    epochs = []
    for epoch in (0, 1):
        per_rank = []
        for rank in (0, 1):
            torch.manual_seed(100 + rank)  # unequal global RNGs, as in an unseeded run
            loader = stateful.StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True)
            sampler = distributed_sampler_for(loader, num_replicas=2, rank=rank, seed=0)
            assert isinstance(sampler, DistributedSamplerWrapper)
            new = reinstantiate_dataloader(loader, sampler)
            sampler.set_epoch(epoch)
            per_rank.append([i for batch in new for i in batch.tolist()])
        _assert_partition(per_rank, 40)
        epochs.append(per_rank)
    assert epochs[0] != epochs[1]


def test_wrapped_order_depends_on_the_seed_and_is_reproducible():
    def order(seed):
        return list(DistributedSamplerWrapper(RandomSampler(range(30)), num_replicas=1, rank=0, shuffle=False, seed=seed))

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert wrapped_sampler_seed(1, 0) != wrapped_sampler_seed(0, 1)
    assert wrapped_sampler_seed(5, 3) == wrapped_sampler_seed(5, 3) and 0 <= wrapped_sampler_seed(5, 3) < 2**63


def test_wrapping_leaves_the_samplers_generator_and_the_global_rngs_alone():
    generator = torch.Generator().manual_seed(11)
    generator_state = generator.get_state()
    sampler = WeightedRandomSampler([1.0] * 20, 20, replacement=True, generator=generator)
    wrapper = DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=True, seed=3)
    torch.manual_seed(5)
    random.seed(5)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    first = list(wrapper)
    assert list(wrapper) == first  # same epoch, same order
    assert sampler.generator is generator and torch.equal(generator.get_state(), generator_state)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    wrapper.set_epoch(1)
    assert list(wrapper) != first


@pytest.mark.parametrize("sampler", [EndlessSampler(), InfiniteLenSampler()])
def test_wrapper_requires_a_finite_length(sampler):
    with pytest.raises(TypeError, match="does not provide `__len__`.*use_distributed_sampler=False"):
        DistributedSamplerWrapper(sampler, num_replicas=2, rank=0)


# ---------------------------------------------------------------------------------------------------------------------
# Choosing the sampler
# ---------------------------------------------------------------------------------------------------------------------


def test_random_and_sequential_samplers_become_distributed_samplers_with_inherited_shuffle():
    dataset = make_dataset()
    shuffled = distributed_sampler_for(DataLoader(dataset, shuffle=True), num_replicas=2, rank=1, seed=5)
    ordered = distributed_sampler_for(DataLoader(dataset), num_replicas=2, rank=0)
    assert type(shuffled) is DistributedSampler and type(ordered) is DistributedSampler
    assert (
        shuffled.shuffle is True and shuffled.seed == 5 and shuffled.rank == 1 and shuffled.num_replicas == 2
    )
    assert ordered.shuffle is False
    assert shuffled.dataset is dataset
    assert list(ordered) == [0, 2, 4, 6, 8]


def test_custom_sampler_is_wrapped_without_shuffle():
    sampler = ReversedSampler(10)
    result = distributed_sampler_for(DataLoader(make_dataset(), sampler=sampler), num_replicas=2, rank=0)
    assert isinstance(result, DistributedSamplerWrapper)
    assert result.sampler is sampler and result.shuffle is False


def test_random_sampler_with_replacement_is_wrapped_and_keeps_shuffle():
    sampler = RandomSampler(make_dataset(), replacement=True)
    result = distributed_sampler_for(DataLoader(make_dataset(), sampler=sampler), num_replicas=2, rank=0)
    assert isinstance(result, DistributedSamplerWrapper) and result.shuffle is True


def test_sampler_inside_a_custom_batch_sampler_is_the_one_replaced():
    dataset = make_dataset()
    batch_sampler = BatchSampler(RandomSampler(dataset), batch_size=2, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=batch_sampler)
    result = distributed_sampler_for(loader, num_replicas=2, rank=0)
    # the loader's own ``.sampler`` is a placeholder SequentialSampler; the shuffle comes from the batch sampler
    assert isinstance(loader.sampler, SequentialSampler)
    assert type(result) is DistributedSampler and result.shuffle is True


def test_iterable_dataset_and_existing_distributed_sampler_are_left_alone():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream_loader = DataLoader(Stream())
    dataset = make_dataset()
    sharded = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert not needs_distributed_sampler(stream_loader)
    assert not needs_distributed_sampler(sharded)
    assert needs_distributed_sampler(DataLoader(dataset))
    assert distributed_sampler_for(stream_loader, num_replicas=2, rank=0) is None
    assert distributed_sampler_for(sharded, num_replicas=2, rank=0) is None


# ---------------------------------------------------------------------------------------------------------------------
# Re-instantiation
# ---------------------------------------------------------------------------------------------------------------------


def collate(batch):
    return batch


def worker_init(worker_id):
    pass


def test_reinstantiate_plain_dataloader_keeps_its_arguments():
    dataset = make_dataset()
    generator = torch.Generator()
    context = multiprocessing.get_context("spawn")
    loader = DataLoader(
        dataset,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=collate,
        pin_memory=True,
        drop_last=True,
        timeout=5,
        worker_init_fn=worker_init,
        multiprocessing_context=context,
        generator=generator,
        prefetch_factor=4,
        persistent_workers=True,
    )
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    new = reinstantiate_dataloader(loader, sampler)

    assert type(new) is DataLoader and new is not loader
    assert new.sampler is sampler
    assert new.batch_sampler.sampler is sampler
    assert new.batch_size == 3 and new.drop_last is True
    assert new.num_workers == 2 and new.collate_fn is collate and new.pin_memory is True
    assert new.timeout == 5 and new.worker_init_fn is worker_init
    assert new.multiprocessing_context is context and new.generator is generator
    assert new.prefetch_factor == 4 and new.persistent_workers is True
    assert new.dataset is dataset


def test_reinstantiate_iterates_the_new_sampler():
    loader = DataLoader(make_dataset(6), batch_size=2)
    new = reinstantiate_dataloader(
        loader, DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    )
    assert [batch[0].tolist() for batch in new] == [[1, 3], [5]]


def test_reinstantiate_uses_a_plain_batch_samplers_batching():
    dataset = make_dataset(8)
    loader = DataLoader(
        dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), batch_size=3, drop_last=True)
    )
    new = reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False))
    assert type(new.batch_sampler) is BatchSampler
    assert new.batch_size == 3 and new.drop_last is True
    assert [batch[0].tolist() for batch in new] == [[0, 2, 4]]


class ScaledLoader(DataLoader):
    """Takes a required argument that it does not keep under the same name."""

    def __init__(self, dataset, scale, **kwargs):
        super().__init__(dataset, **kwargs)
        self._scale = scale


def test_subclass_with_unstored_argument_fails_outside_capture():
    loader = ScaledLoader(make_dataset(), 3, batch_size=2)
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=0)
    with pytest.raises(DataLoaderRebuildError) as info:
        reinstantiate_dataloader(loader, sampler)
    message = str(info.value)
    # the reference's words, then how to fix it
    assert message.startswith(
        "Trying to inject custom `Sampler` into the `ScaledLoader` instance. This would fail as some of the"
        " `__init__` arguments are not available as instance attributes. The missing attributes are ['scale']."
    )
    assert "fabric.launch" in message and "use_distributed_sampler=False" in message
    assert isinstance(info.value, TypeError)


def test_subclass_with_unstored_argument_works_inside_capture():
    with capture_init_arguments():
        loader = ScaledLoader(make_dataset(), 3, batch_size=2, num_workers=1, shuffle=True)
    assert getattr(loader, "__fabric_init_args") == (
        (loader.dataset, 3),
        {"batch_size": 2, "num_workers": 1, "shuffle": True},
    )
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=0)
    new = reinstantiate_dataloader(loader, sampler)
    assert type(new) is ScaledLoader
    assert new._scale == 3 and new.sampler is sampler
    assert new.batch_size == 2 and new.num_workers == 1
    # the patches are gone after the block
    assert "__fabric_init_args" not in vars(ScaledLoader(make_dataset(), 1))


def test_capture_covers_subclasses_defined_inside_the_block():
    with capture_init_arguments():

        class LateLoader(DataLoader):
            def __init__(self, dataset, factor):
                super().__init__(dataset, batch_size=factor)

        loader = LateLoader(make_dataset(), 2)
    assert getattr(loader, "__fabric_init_args") == ((loader.dataset, 2), {})
    assert "__fabric_init_args" not in vars(LateLoader(make_dataset(), 2))


def test_capture_is_reentrant_and_restores_init():
    original = DataLoader.__init__
    with capture_init_arguments():
        with capture_init_arguments():
            pass
        assert "__fabric_init_args" in vars(DataLoader(make_dataset()))
    assert DataLoader.__init__ is original
    assert "__init_subclass__" not in DataLoader.__dict__


def test_subclass_that_cannot_accept_the_sampler_raises():
    class FixedLoader(DataLoader):
        def __init__(self, dataset):
            super().__init__(dataset, batch_size=2)

    loader = FixedLoader(make_dataset())
    with pytest.raises(DataLoaderRebuildError) as info:
        reinstantiate_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))
    assert str(info.value).startswith(
        "Trying to inject parameters into the `FixedLoader` instance. This would fail as it doesn't expose all"
        " its attributes in the `__init__` signature. The missing arguments are ['sampler']"
    )
    assert "Add them to the signature" in str(info.value)


class PinnedBatchSizeLoader(DataLoader):
    """Sets ``batch_size`` itself and forwards ``**kwargs``, which may carry ``batch_size`` again."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, batch_size=2, **kwargs)


def test_subclass_passing_an_argument_twice_gets_an_explanation():
    loader = PinnedBatchSizeLoader(make_dataset())
    with pytest.raises(DataLoaderRebuildError) as info:
        reinstantiate_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))
    message = str(info.value)
    assert message.startswith(
        "The `PinnedBatchSizeLoader` implementation has an error where more than one `__init__` argument can be"
        " passed to its parent's `batch_size=...` `__init__` argument."
    )
    assert "`kwargs` so they don't contain the `batch_size` key" in message and "kwargs.pop('batch_size'" in message
    assert isinstance(info.value, TypeError)
    assert "got multiple values for keyword argument 'batch_size'" in str(info.value.__cause__)


def test_other_type_errors_of_the_constructor_pass_through():
    class Picky(DataLoader):
        def __init__(self, dataset, **kwargs):
            if kwargs.get("sampler") is not None:
                raise TypeError("Picky refuses samplers")
            super().__init__(dataset, **kwargs)

    loader = Picky(make_dataset())
    with pytest.raises(TypeError, match="^Picky refuses samplers$"):
        reinstantiate_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))


class GroupedBatchSampler(BatchSampler):
    """Custom batching with an extra argument that is not stored as an attribute."""

    def __init__(self, sampler, group_size, batch_size):
        super().__init__(sampler, batch_size, drop_last=False)
        self._group_size = group_size


def test_custom_batch_sampler_is_rebuilt_around_the_new_sampler():
    dataset = make_dataset(8)
    with capture_init_arguments():
        loader = DataLoader(
            dataset, batch_sampler=GroupedBatchSampler(SequentialSampler(dataset), 4, batch_size=2)
        )
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    new = reinstantiate_dataloader(loader, sampler)
    assert type(new.batch_sampler) is GroupedBatchSampler
    assert new.batch_sampler is not loader.batch_sampler
    assert new.batch_sampler.sampler is sampler and new.batch_sampler._group_size == 4
    assert [batch[0].tolist() for batch in new] == [[1, 3], [5, 7]]


def test_custom_batch_sampler_from_attributes():
    class PlainSubclass(BatchSampler):
        pass

    dataset = make_dataset(4)
    loader = DataLoader(dataset, batch_sampler=PlainSubclass(SequentialSampler(dataset), 2, True))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    new = reinstantiate_dataloader(loader, sampler)
    assert type(new.batch_sampler) is PlainSubclass
    assert new.batch_sampler.batch_size == 2 and new.batch_sampler.drop_last is True
    assert [batch[0].tolist() for batch in new] == [[0, 2]]


def test_custom_batch_sampler_with_unstored_argument_fails_outside_capture():
    dataset = make_dataset(8)
    loader = DataLoader(
        dataset, batch_sampler=GroupedBatchSampler(SequentialSampler(dataset), 4, batch_size=2)
    )
    with pytest.raises(
        DataLoaderRebuildError,
        match=r"^Trying to inject custom `Sampler` into the `GroupedBatchSampler` instance\..*\['group_size'\]",
    ):
        reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0))


def test_custom_batch_sampler_without_a_sampler_argument_raises():
    class FixedBatches(BatchSampler):
        def __init__(self, batch_size):
            super().__init__(SequentialSampler(range(8)), batch_size, drop_last=False)

    dataset = make_dataset(8)
    loader = DataLoader(dataset, batch_sampler=FixedBatches(2))
    with pytest.raises(DataLoaderRebuildError) as info:
        reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0))
    assert str(info.value).startswith(
        "Trying to inject a modified sampler into the batch sampler; however, it seems the class `FixedBatches`"
        " does not have an argument called `sampler`"
    )
    assert "use_distributed_sampler=False" in str(info.value)


def test_custom_batch_sampler_passing_an_argument_twice_gets_an_explanation():
    class PairBatches(BatchSampler):
        def __init__(self, sampler, **kwargs):
            super().__init__(sampler, batch_size=2, **kwargs)

    dataset = make_dataset(8)
    loader = DataLoader(dataset, batch_sampler=PairBatches(SequentialSampler(dataset), drop_last=False))
    with pytest.raises(DataLoaderRebuildError, match=r"^The `PairBatches` implementation has an error.*`batch_size=\.\.\.`"):
        reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0))


class DuckBatches:
    """``BatchSampler``'s interface without subclassing it."""

    def __init__(self, sampler, batch_size, drop_last):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)


def test_batch_sampler_with_the_batch_sampler_interface_is_rebuilt_around_the_new_sampler():
    dataset = make_dataset(10)
    loader = DataLoader(dataset, batch_sampler=DuckBatches(SequentialSampler(dataset), 2, drop_last=True))
    sampler = distributed_sampler_for(loader, num_replicas=2, rank=1)
    new = reinstantiate_dataloader(loader, sampler)
    assert type(new.batch_sampler) is DuckBatches and new.batch_sampler is not loader.batch_sampler
    assert new.batch_sampler.sampler is sampler
    assert new.batch_sampler.batch_size == 2 and new.batch_sampler.drop_last is True
    assert [batch[0].tolist() for batch in new] == [[1, 3], [5, 7]]  # rank 1's half, the last odd one dropped


def test_batch_sampler_with_the_interface_but_another_constructor_raises():
    class Chunks(DuckBatches):
        def __init__(self, indices):
            super().__init__(indices, batch_size=2, drop_last=False)

    dataset = make_dataset(4)
    loader = DataLoader(dataset, batch_sampler=Chunks(list(range(4))))
    with pytest.raises(DataLoaderRebuildError) as info:
        reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0))
    message = str(info.value)
    assert "can't inject a (distributed) sampler into your batch sampler `Chunks`, because it doesn't subclass" in message
    assert "`Chunks(sampler, batch_size=..., drop_last=...)` failed" in message
    assert "follow the API of `BatchSampler`" in message and "use_distributed_sampler=False" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value.__cause__, TypeError)


def test_batch_sampler_without_the_interface_raises():
    class Pairs:
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    dataset = make_dataset(4)
    loader = DataLoader(dataset, batch_sampler=Pairs())
    with pytest.raises(
        TypeError,
        match=r"^Fabric can't inject a \(distributed\) sampler into your batch sampler `Pairs`, because it doesn't"
        r" subclass PyTorch's `BatchSampler`.*follow the API of `BatchSampler`.*use_distributed_sampler=False",
    ):
        reinstantiate_dataloader(loader, DistributedSampler(dataset, num_replicas=2, rank=0))


def test_stateful_dataloader_builds_its_own_batch_sampler_around_the_new_sampler():
    """torchdata's StatefulDataLoader makes a BatchSampler subclass of its own; it is not a user's batch sampler."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="`make setup` installs torchdata")
    loader = stateful.StatefulDataLoader(list(range(10)), batch_size=3, drop_last=True)
    sampler = distributed_sampler_for(loader, num_replicas=2, rank=0)
    new = reinstantiate_dataloader(loader, sampler)
    assert type(new) is stateful.StatefulDataLoader
    assert new.sampler is sampler  # not a placeholder: `loader.sampler.set_epoch` reaches the sampler in use
    assert type(new.batch_sampler) is type(loader.batch_sampler) and new.batch_sampler.sampler is sampler
    assert new.batch_size == 3 and new.drop_last is True
    assert [batch.tolist() for batch in new] == [[0, 2, 4]]


def test_which_iterable_datasets_shard_themselves():
    from types import SimpleNamespace

    from fabric_core.utilities.data import shards_itself

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    class Declared(Stream):
        world_size = 2

    class LitStyle(Stream):  # litdata keeps the layout it detected in `distributed_env`
        def __init__(self, world_size):
            self.distributed_env = SimpleNamespace(world_size=world_size, global_rank=0)

    class HFStyle(Stream):  # 🤗 Datasets' split_dataset_by_node sets `_distributed`
        _distributed = SimpleNamespace(rank=1, world_size=2)

    LibraryStream = type("StreamingDataset", (Stream,), {"__module__": "litdata.streaming.dataset"})
    assert not shards_itself(Stream(), 2)
    assert shards_itself(Declared(), 2) and not shards_itself(Declared(), 4)  # a stale layout does not count
    assert shards_itself(LitStyle(2), 2) and not shards_itself(LitStyle(1), 2)
    assert shards_itself(HFStyle(), 2)
    assert shards_itself(LibraryStream(), 8)
    assert not shards_itself(type("Flag", (Stream,), {"world_size": True})(), 1)  # a bool is not a world size
