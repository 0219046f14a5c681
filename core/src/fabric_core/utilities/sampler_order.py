"""A sampler's order drawn the same way on every rank: the seed of each epoch, RNGs seeded with it, and an indexable
view of what the sampler yields. Shared by the distributed sampler over another sampler
(:class:`~fabric_core.utilities.data.DistributedSamplerWrapper`) and the global sample order
(:mod:`fabric_core.utilities.global_order`), which must agree on it; a module of its own so neither imports the
other."""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["SamplerIndices", "seeded_draws", "wrapped_sampler_seed"]


def wrapped_sampler_seed(seed: int, epoch: int) -> int:
    """The seed a wrapped sampler draws its order from in ``epoch``: the same on every rank, new every epoch.

    Derived by hashing, so it is the same in every process and on every platform, and does not coincide with the
    ``seed + epoch`` the ``DistributedSampler`` shuffles positions with.
    """
    digest = hashlib.blake2b(f"fabric-wrapped-sampler:{int(seed)}:{int(epoch)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@contextmanager
def seeded_draws(sampler: object, seed: int) -> Iterator[None]:
    """Make what ``sampler`` draws while the block runs a function of ``seed`` alone; restore everything after.

    * a ``generator`` attribute that holds ``None`` or a ``torch.Generator`` (torch's and torchdata's samplers) is
      replaced by a fresh generator seeded with ``seed``, then put back;
    * the global RNGs of torch (CPU), Python's ``random`` and, if already imported, NumPy are seeded with ``seed``
      and restored afterwards, so samplers that draw from them without a generator agree too, and the user's
      global random streams are not advanced by materialising the sampler.
    """
    saved_random = random.getstate()
    numpy = sys.modules.get("numpy")
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    swapped = False
    original = getattr(sampler, "generator", None)
    if hasattr(sampler, "generator") and (original is None or isinstance(original, torch.Generator)):
        device = original.device if original is not None else "cpu"
        try:
            sampler.generator = torch.Generator(device=device).manual_seed(seed)  # type: ignore[attr-defined]
            swapped = True
        except (AttributeError, TypeError):  # a read-only property: the global RNGs below still apply
            pass
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            if numpy is not None:
                numpy.random.seed(seed % 2**32)
            yield
    finally:
        if swapped:
            sampler.generator = original  # type: ignore[attr-defined]
        random.setstate(saved_random)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)


class SamplerIndices:
    """Indexable view of the indices a sampler yields, so ``DistributedSampler`` can shard them like a dataset."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._indices: list[Any] | None = None

    def refresh(self, seed: int | None = None) -> None:
        """Materialise the sampler's order for this pass (random samplers yield a new one every epoch).

        With ``seed``, the sampler draws from RNGs seeded with it (see :func:`seeded_draws`), so every rank
        materialises the same order.
        """
        if seed is None:
            self._indices = list(self.sampler)
            return
        with seeded_draws(self.sampler, seed):
            self._indices = list(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __getitem__(self, position: int) -> Any:
        if self._indices is None:
            self.refresh()
        assert self._indices is not None
        return self._indices[position]
