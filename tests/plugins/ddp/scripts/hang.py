"""A rank that gets stuck in user code; run by ``test_hang_detection.py`` with ``FABRIC_HANG_TIMEOUT`` set.

    python hang.py LAUNCHER STUCK_RANK OUTDIR      (LAUNCHER: script | spawn | cli)

Every rank trains a few steps (progress), then rank STUCK_RANK writes ``stuck_at`` and sleeps on the line marked
``STUCK HERE`` while the others wait for it in an all_reduce. With STUCK_RANK -1 nobody is stuck and every rank
writes ``done<rank>``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from fabric_core import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: the scripts' shared helpers
from script_helpers import run_on_two_ranks  # noqa: E402

LAUNCHER, STUCK, OUTDIR = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])


def body(fabric: Fabric) -> None:
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        loss = model(torch.randn(8, 4)).sum()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    if fabric.global_rank == STUCK:
        (OUTDIR / "stuck_at").write_text(str(time.time()))
        time.sleep(600)  # STUCK HERE
    fabric.all_reduce(torch.ones(1))
    if STUCK >= 0:
        raise AssertionError("the all_reduce with a stuck peer returned")
    (OUTDIR / f"done{fabric.global_rank}").write_text("ok")


if __name__ == "__main__":
    run_on_two_ranks(body, LAUNCHER)
