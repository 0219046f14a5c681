"""Rank 1 dies in the middle of the rendezvous; run by ``test_ddp_failures.py``.

    python rendezvous_death.py LAUNCHER WHERE OUTDIR      (LAUNCHER: script | spawn | cli)

``WHERE`` is the moment rank 1 raises: ``before`` (as it starts joining), ``during`` (connected to the store, while
the process group is being created) or ``after`` (the group exists; rank 0 is in its first collective and fails with
"Connection closed by peer" once rank 1 is gone). Rank 1's error names itself; the job's output must end with it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fabric_core import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the scripts' shared helpers
from script_helpers import run_on_two_ranks  # noqa: E402

LAUNCHER, WHERE, OUTDIR = sys.argv[1], sys.argv[2], sys.argv[3]


def _rank_one() -> bool:
    return os.environ.get("LOCAL_RANK") == "1"


def _die() -> None:
    Path(OUTDIR, "raised_at").write_text(str(time.time()))
    raise RuntimeError(f"rank 1 dies during the rendezvous ({WHERE}) on purpose")


def _patch() -> None:
    """Make rank 1 fail at WHERE (module level: spawned workers import this file but skip __main__)."""
    if WHERE == "during":
        create = c10d._new_process_group_helper

        def failing_create(*args, **kwargs):
            if _rank_one():
                _die()
            return create(*args, **kwargs)

        c10d._new_process_group_helper = failing_create
        return
    init = dist.init_process_group

    def failing_init(*args, **kwargs):
        if WHERE == "before" and _rank_one():
            _die()
        result = init(*args, **kwargs)
        if WHERE == "after" and _rank_one():
            time.sleep(0.5)  # rank 0 is in its collective by now
            _die()
        return result

    dist.init_process_group = failing_init


_patch()


def body(fabric: Fabric) -> None:
    fabric.all_reduce(torch.ones(1))
    raise AssertionError("the collective without rank 1 returned")


if __name__ == "__main__":
    run_on_two_ranks(body, LAUNCHER)
