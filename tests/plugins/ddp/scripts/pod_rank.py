"""One process of a job started in a (simulated) Kubeflow pod: which rank and world it joined.

``python pod_rank.py OUTDIR launch`` runs as the pod's own command (Fabric starts the node's processes);
``fabric run pod_rank.py OUTDIR cli`` runs under fabric run. Every rank all-reduces its rank + 1, so a node that
formed a world of its own shows a wrong sum, and writes ``rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fabric_core import Fabric

outdir, mode = Path(sys.argv[1]), sys.argv[2]
fabric = Fabric(accelerator="cpu")  # devices, num_nodes, ranks and rendezvous: from the pod's variables
if mode == "launch":
    fabric.launch()
total = fabric.all_reduce(torch.tensor([fabric.global_rank + 1.0]), reduce_op="sum")
result = {
    "global_rank": fabric.global_rank,
    "world_size": fabric.world_size,
    "node_rank": fabric.node_rank,
    "local_rank": fabric.local_rank,
    "sum": total.item(),
}
(outdir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
fabric.barrier()
