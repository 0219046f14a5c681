"""Run by ``fabric run --max-restarts N``: rank 1 fails in the first FAILS attempts, then the job succeeds.

    python flaky_rank.py OUTDIR FAILS

Every rank writes ``attempt<A>-rank<R>`` (its pid) once its process group is up; the last rank 0 writes ``result``
(the sum of the attempt numbers over the ranks, proving both ranks of the final attempt met).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from fabric_core import Fabric

out, fails = Path(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fabric = Fabric()
(out / f"attempt{attempt}-rank{fabric.global_rank}").write_text(str(os.getpid()))
if fabric.global_rank == 1 and attempt < fails:
    raise RuntimeError(f"rank 1 fails in attempt {attempt} on purpose")
total = fabric.all_reduce(torch.tensor([float(attempt)]), reduce_op="sum")
if fabric.global_rank == 0:
    (out / "result").write_text(str(int(total.item())))
