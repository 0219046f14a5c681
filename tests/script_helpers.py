"""Helpers for the worker scripts that tests run as real rank processes (tests/plugins/*/scripts/).

The scripts' own ``*_common`` modules put ``tests/`` on ``sys.path`` and re-export these, so every plugin's
scenarios report progress, results and expected errors the same way.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

_T0 = time.perf_counter()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def mark(what: str) -> None:
    """Progress with a timestamp (shown by the test harness when a run fails or is slow)."""
    print(f"[{time.perf_counter() - _T0:7.2f}s] {what}", flush=True)


def dump(path: str | os.PathLike, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1))


def expect_error(kind: type[BaseException], match: str, fn, *args, **kwargs) -> str:
    """Call ``fn`` and return the message of the ``kind`` error it must raise, which must contain ``match``."""
    try:
        fn(*args, **kwargs)
    except kind as err:
        assert match in str(err), f"{kind.__name__} message {str(err)!r} lacks {match!r}"
        return str(err)
    raise AssertionError(f"expected {kind.__name__} ({match!r}) from {fn}")


def out_dir() -> Path:
    """The output folder the test passed as the script's first argument."""
    return Path(sys.argv[1])


def run_on_two_ranks(body, launcher: str) -> None:
    """``body(fabric)`` on 2 CPU ranks, started the way ``launcher`` says: ``cli`` (``fabric run`` started this
    process: a plain ``Fabric()``), ``spawn`` (``ddp_spawn`` runs ``body`` in new processes), otherwise ``script``
    (``ddp`` re-runs this script for rank 1)."""
    from fabric_core import Fabric

    if launcher == "cli":
        body(Fabric())
    elif launcher == "spawn":
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(body)
    else:
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
        fabric.launch()
        body(fabric)


class GlobalRngSampler(torch.utils.data.Sampler):
    """A sampler without a ``generator`` attribute that draws from torch's and Python's global RNGs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        import random

        order = torch.randperm(self.n).tolist()
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n
