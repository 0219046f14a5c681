"""2-process jobs that fail or get stuck on purpose; run by ``test_ddp_failures.py``.

    python crash.py MODE OUTDIR

Every rank writes ``pid<rank>`` (its pid) and then ``ready<rank>`` once the process group is up. Modes:

* ``child_raises``  - strategy="ddp": rank 1 raises while rank 0 waits in a collective.
* ``parent_raises`` - strategy="ddp": rank 0 raises while rank 1 waits in a collective.
* ``stuck``         - strategy="ddp": both ranks block forever inside a C++ receive (for signal tests).
* ``late_child_failure`` - strategy="ddp": rank 0 finishes its script normally; rank 1 raises a second later.
* ``unmatched_collective`` - strategy="ddp": rank 0 finishes; rank 1 waits in a collective rank 0 never joins.
* ``fork_child_raises``  - strategy="ddp_fork": worker 1 raises; the caller must raise promptly.
* ``cli_child_raises``   - under ``fabric run``: rank 1 raises.
* ``child_exits_hard``   - strategy="ddp": rank 1 ends with ``os._exit(7)`` while rank 0 waits in a collective.
* ``child_killed``       - strategy="ddp": rank 1 is SIGKILLed while rank 0 waits in a collective.
* ``spawn_stuck``        - strategy="ddp_spawn": both workers block in a receive (SIGINT to the caller must end it).
* ``zero_first_slow``    - strategy="ddp", a 2 s collective timeout: rank 0 takes 5 s inside ``rank_zero_first()``; all pass.
* ``zero_first_fails``   - strategy="ddp": rank 0 raises inside ``rank_zero_first()`` while the others wait.
* ``mismatched``         - strategy="ddp": ranks all_reduce tensors of different shapes, then broadcast from src=5.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fabric_core import Fabric


def note(outdir: str, name: str, value: object) -> None:
    path = Path(outdir, name)
    path.with_suffix(".tmp").write_text(str(value))
    path.with_suffix(".tmp").replace(path)


def body(fabric: Fabric, outdir: str, mode: str) -> None:
    rank = fabric.global_rank
    note(outdir, f"pid{rank}", os.getpid())
    fabric.barrier()  # the process group works
    note(outdir, f"ready{rank}", time.time())
    failing = 0 if mode == "parent_raises" else 1
    if mode.endswith("raises"):
        if rank == failing:
            time.sleep(0.5)  # let the other rank settle into its collective first
            note(outdir, "raised_at", time.time())
            raise RuntimeError(f"rank {rank} fails on purpose")
        fabric.all_reduce(torch.ones(1))  # never completes: the peer is gone
        raise AssertionError("the collective with a dead peer returned")
    if mode == "late_child_failure":
        if rank == 1:
            time.sleep(1.0)
            note(outdir, "raised_at", time.time())
            raise RuntimeError("rank 1 fails on purpose, after rank 0 is done")
        return
    if mode == "unmatched_collective":
        if rank == 1:
            note(outdir, "raised_at", time.time())  # the moment it starts waiting for good
            fabric.all_reduce(torch.ones(1))
            raise AssertionError("the collective without rank 0 returned")
        time.sleep(0.5)
        return
    if mode in ("child_exits_hard", "child_killed"):
        if rank == 1:
            time.sleep(0.5)
            note(outdir, "raised_at", time.time())
            if mode == "child_killed":
                os.kill(os.getpid(), 9)
            os._exit(7)
        fabric.all_reduce(torch.ones(1))
        raise AssertionError("the collective with a dead peer returned")
    if mode == "zero_first_slow":
        # A 2-second collective timeout from here on (torch's test helper): the start-up rendezvous of a busy
        # machine keeps the default, so only the wait inside rank_zero_first is what is being timed.
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=2))
        with fabric.rank_zero_first():
            if rank == 0:
                time.sleep(5.0)  # longer than the collective timeout (FABRIC_TIMEOUT=2)
                note(outdir, "downloaded", time.time())
            else:
                assert Path(outdir, "downloaded").exists(), "rank 1 ran before rank 0 finished"
        fabric.barrier()
        note(outdir, f"done{rank}", time.time())
        return
    if mode == "zero_first_fails":
        with fabric.rank_zero_first():
            if rank == 0:
                time.sleep(0.5)
                note(outdir, "raised_at", time.time())
                raise RuntimeError("rank 0 fails inside rank_zero_first on purpose")
        raise AssertionError("rank 1 got past rank_zero_first although rank 0 failed")
    if mode == "mismatched":
        errors = []
        try:
            fabric.all_reduce(torch.ones(2 + rank))
        except ValueError as err:
            errors.append(str(err))
        try:
            fabric.broadcast("x", src=5)
        except ValueError as err:
            errors.append(str(err))
        note(outdir, f"errors{rank}", "\n".join(errors))
        fabric.barrier()  # the process group still works after the refused calls
        return
    if mode in ("stuck", "spawn_stuck"):
        dist.recv(torch.zeros(1), src=1 - rank)  # both wait to receive; nobody sends
    raise AssertionError(f"unexpected end of mode {mode!r}")


if __name__ == "__main__":
    mode, outdir = sys.argv[1], sys.argv[2]
    if mode == "cli_child_raises":
        body(Fabric(), outdir, mode)
    elif mode == "fork_child_raises":
        Fabric(accelerator="cpu", strategy="ddp_fork", devices=2).launch(body, outdir, mode)
    elif mode == "spawn_stuck":
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(body, outdir, mode)
    else:
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
        fabric.launch()
        body(fabric, outdir, mode)
