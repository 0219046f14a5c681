"""Every rank writes what ``fabric.run_info`` says to ``<out>/attempt<A>-rank<R>.json``.

``python run_identity_job.py OUT launch|spawn|cli [fail]``: started by ``fabric.launch()`` (subprocess launcher), by
``ddp_spawn``, or by ``fabric run`` (the script then calls no launch). ``fail``: rank 1 of attempt 0 exits 3 after
writing, so that ``fabric run --max-restarts 1`` starts attempt 1.
"""

import json
import os
import sys
from pathlib import Path

from fabric_core import Fabric


def work(fabric: Fabric, out: Path, fail: bool) -> None:
    info = fabric.run_info
    info.path("probe", f"rank{fabric.global_rank}.txt").write_text("written")  # the folder exists from a write on
    fabric.barrier()
    record = {**info.as_dict(), "global_rank": fabric.global_rank, "world_size": fabric.world_size}
    (out / f"attempt{info.attempt}-rank{fabric.global_rank}.json").write_text(json.dumps(record))
    if fail and info.restart == 0 and fabric.global_rank == 1:
        os._exit(3)


def main(out: Path, mode: str, fail: bool) -> None:
    if mode == "cli":
        work(Fabric(accelerator="cpu"), out, fail)
    elif mode == "launch":
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, loggers={"csv": {"root_dir": str(out / "logs")}})
        fabric.launch()
        work(fabric, out, fail)
    else:
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(work, out, fail)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "fail")
