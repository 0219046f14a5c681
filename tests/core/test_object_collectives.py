"""Object collectives without numpy, on 2 real gloo ranks whose interpreter cannot import numpy.

torch's ``broadcast_object_list`` needs numpy (which torch does not declare); ``fabric.broadcast`` and the helpers
in ``fabric_core.utilities.object_collectives`` must not. The ranks block numpy before importing torch, as in a
venv that has none; torch's own call failing there shows the block is real.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from jobs import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = textwrap.dedent(
    """
    import json, sys
    sys.modules["numpy"] = None  # `import numpy` fails from here on, as in a venv without numpy
    import torch
    import torch.distributed as dist
    from fabric_core import Fabric
    from fabric_core.strategies import ParallelStrategy
    from fabric_core.utilities.object_collectives import all_gather_object, broadcast_object

    # The core's own process-group strategy: this runs wherever fabric-core is installed (the XLA lane has no
    # fabric-ddp); `strategy="ddp"` takes the same path.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ParallelStrategy())
    fabric.launch()
    rank = fabric.global_rank
    result = {}
    try:
        dist.broadcast_object_list([rank], src=0)
        result["torch_without_numpy"] = "worked"
    except RuntimeError as err:
        result["torch_without_numpy"] = str(err)
    result["fabric_broadcast"] = fabric.broadcast({"step": 3, "from": rank, "t": torch.arange(3)}, src=1)
    result["fabric_broadcast"]["t"] = result["fabric_broadcast"]["t"].tolist()
    result["long"] = len(broadcast_object("x" * 3_000_000 if rank == 0 else None))
    result["none"] = broadcast_object(None if rank == 1 else "set", src=1)
    result["gathered"] = all_gather_object({"rank": rank, "payload": "y" * (10 + 1000 * rank)})
    result["gathered"] = [(g["rank"], len(g["payload"])) for g in result["gathered"]]
    group = dist.new_group(backend="gloo")
    result["group"] = all_gather_object(rank * 10, group=group)
    with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
        json.dump(result, f)
    """
)


def test_object_collectives_need_no_numpy(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_ranks(script, str(tmp_path), tmp_path=tmp_path, timeout=180)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if rank == 1:  # the receiver decodes (rank 0 sends)
            assert "Numpy is not available" in result["torch_without_numpy"]
        assert result["fabric_broadcast"] == {"step": 3, "from": 1, "t": [0, 1, 2]}
        assert result["long"] == 3_000_000
        assert result["none"] is None
        assert result["gathered"] == [[0, 10], [1, 1010]]
        assert result["group"] == [0, 10]
