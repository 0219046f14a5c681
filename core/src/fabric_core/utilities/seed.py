"""Reproducible seeding for Python, NumPy and torch, including DataLoader worker processes.

The chosen seed is also written to the environment (``PL_GLOBAL_SEED``, ``PL_SEED_WORKERS``) so that processes
started later by a launcher, and samplers created elsewhere, pick up the same seed without it being passed around.
NumPy is optional: it is seeded when importable and never imported at module load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from typing import Any

import torch

from fabric_core.utilities.rank_zero import get_rank, rank_prefixed_message, rank_zero_warn

__all__ = ["seed_everything", "reset_seed", "worker_init_function"]

log = logging.getLogger(__name__)

_SEED_ENV = "PL_GLOBAL_SEED"
_WORKERS_ENV = "PL_SEED_WORKERS"
# The tightest range every seeded library accepts (numpy's legacy global RNG takes 32-bit seeds).
_MIN_SEED = 0
_MAX_SEED = 2**32 - 1


def _numpy() -> Any | None:
    """NumPy if installed; fabric_core must work without it."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def seed_everything(seed: Any = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed ``random``, NumPy (if installed) and torch on all devices, and record the seed in the environment.

    Args:
        seed: the seed; anything ``int()`` accepts. ``None`` reads ``PL_GLOBAL_SEED`` and falls back to 0.
        workers: record ``PL_SEED_WORKERS=1`` so dataloaders set up later install :func:`worker_init_function`,
            giving every worker process its own, reproducible seed.
        verbose: log the chosen seed and warn when falling back to 0.

    Returns:
        The seed actually used.
    """
    if seed is None:
        env_seed = os.environ.get(_SEED_ENV)
        if env_seed is None:
            seed = 0
            if verbose:
                rank_zero_warn(f"No seed found, seed set to {seed}")
        else:
            try:
                seed = int(env_seed)
            except ValueError:
                raise ValueError(f"Invalid seed specified via {_SEED_ENV}: {env_seed!r}") from None
    elif not isinstance(seed, int):
        seed = int(seed)

    if not (_MIN_SEED <= seed <= _MAX_SEED):
        raise ValueError(f"{seed} is not in bounds, numpy accepts from {_MIN_SEED} to {_MAX_SEED}")

    if verbose:
        log.info(rank_prefixed_message(f"Seed set to {seed}"))

    os.environ[_SEED_ENV] = str(seed)
    os.environ[_WORKERS_ENV] = f"{int(bool(workers))}"
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily, if CUDA is initialised later)
    return seed


def reset_seed() -> None:
    """Re-apply the seed recorded by :func:`seed_everything`, e.g. in a freshly spawned process.

    Does nothing when no seed was recorded, so calling it unconditionally is safe.
    """
    seed = os.environ.get(_SEED_ENV)
    if seed is None:
        return
    workers = os.environ.get(_WORKERS_ENV, "0")
    seed_everything(int(seed), workers=bool(int(workers)), verbose=False)


def _derive_seed_words(base_seed: int, worker_id: int, rank: int, count: int = 4) -> list[int]:
    """Mix (base seed, worker, rank) into ``count`` independent 32-bit words.

    A cryptographic hash rather than ``base + worker_id`` so that nearby inputs (worker 1 of rank 0 versus worker
    0 of rank 1, or consecutive epochs) give unrelated streams. It does not depend on NumPy, so the same inputs
    give the same seeds whether or not NumPy is installed.
    """
    key = f"fabric_core.worker_seed:{base_seed}:{worker_id}:{rank}".encode()
    digest = hashlib.blake2b(key, digest_size=4 * count).digest()
    return [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(count)]


def worker_init_function(worker_id: int, rank: int | None = None) -> None:
    """``DataLoader(worker_init_fn=...)`` that gives each worker on each rank its own torch/random/NumPy seed.

    Without it, every worker (and every rank) forks the same Python and NumPy RNG state and produces identical
    "random" augmentations. The base seed is the one the DataLoader assigned to this worker minus ``worker_id``:
    it is drawn from the (seeded) main-process generator once per epoch, so results stay reproducible yet differ
    between epochs.

    Args:
        worker_id: the worker index the DataLoader passes in.
        rank: the global rank; defaults to the rank known to :mod:`fabric_core.utilities.rank_zero`.
    """
    global_rank = get_rank() if rank is None else rank
    base_seed = torch.initial_seed() - worker_id
    words = _derive_seed_words(base_seed, worker_id, global_rank, count=4)
    log.debug(
        f"[rank: {global_rank}] Seeding DataLoader worker {worker_id} from base seed {base_seed} (words {words})"
    )
    torch.manual_seed((words[0] << 32) | words[1])
    random.seed((words[2] << 32) | words[3])
    np = _numpy()
    if np is not None:
        # Legacy global RNG: takes a sequence of uint32 words, so all 128 bits of mixing are used.
        np.random.seed(words)
