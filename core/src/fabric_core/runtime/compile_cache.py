"""torch.compile's cache artifacts kept in the run folder, so a restarted process does not compile from nothing.

Inductor and AOTAutograd cache what they compile on local disk (``/tmp/torchinductor_<user>`` by default), which a
replaced node, a new container or a cleaned ``/tmp`` does not have. ``torch.compiler.save_cache_artifacts()`` packs
what this process compiled (FX graphs, AOTAutograd, autotuning results) into bytes, and
``torch.compiler.load_cache_artifacts()`` puts them back into the local caches of a new process, before its first
compile. :func:`store` writes them to ``<run folder>/compile-cache/rank-<r>.bin`` (atomically; once the compiled steps
ran, e.g. at the first disk checkpoint) and :func:`restore` loads this rank's file (rank 0's if this rank has none, as
after a resize) at the start of every attempt. What it saves is measured in docs/benchmarks.md (``tiers`` section).
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER = "compile-cache"


def _file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.bin"


def restore(folder: Path, rank: int) -> bool:
    """Load the cache artifacts stored for ``rank`` (or rank 0) into this process's compile caches; whether any were
    found. Call before the first compiled call."""
    import torch

    for candidate in (_file(folder, rank), _file(folder, 0)):
        try:
            data = candidate.read_bytes()
        except OSError:
            continue
        if data:
            torch.compiler.load_cache_artifacts(data)
            return True
    return False


def store(folder: Path, rank: int) -> int:
    """Write what this process compiled so far; returns the bytes written (0: nothing compiled yet)."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    if not data:
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    target = _file(folder, rank)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return len(data)
