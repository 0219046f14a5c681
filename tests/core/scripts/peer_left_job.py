"""Rank 1 returns without reaching the barrier rank 0 waits in; rank 0 writes the error it got to
``<out>/rank0.json`` (and exits 0, so the job's outcome is what the test reads)."""

import json
import sys
from pathlib import Path

from fabric_core import Fabric


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    fabric.barrier()  # both ranks are connected
    if fabric.global_rank == 1:
        return  # leaves the job early
    try:
        fabric.barrier()  # the barrier rank 1 never reaches
        error = None
    except RuntimeError as err:
        error = f"{type(err).__name__}: {err}"
    (out / "rank0.json").write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
