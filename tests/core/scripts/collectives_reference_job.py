"""``TorchCollective``'s reduce_scatter, all_to_all, gather_object and monitored_barrier next to torch.distributed's
own calls on the same inputs, in one job of 2 real processes (gloo). Writes ``<out>/reference<r>.json``: for each
case what ours returned (and the tensors it filled) and what torch.distributed gave."""

import json
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fabric_core.collectives import TorchCollective


def inputs(rank: int, size: int) -> list[torch.Tensor]:
    """Distinct values per (rank, destination), one float32 row of 3 each, so a swap or a wrong op shows."""
    return [torch.tensor([rank * 100.0 + peer * 10.0 + k for k in range(3)]) ** 1.5 for peer in range(size)]


def attempt(call, *args, **kwargs):
    """What ``call(*args, **kwargs)`` returned, or torch's error as text (an older torch's gloo may lack a collective:
    then ours must fail the same way)."""
    try:
        return call(*args, **kwargs)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def main(out: Path) -> None:
    world = TorchCollective().setup(backend="gloo").create_group()
    rank, size = world.rank, world.world_size
    seen: dict = {}
    for op in ("sum", "max", "min", "product"):
        filled, expected = torch.empty(3), torch.empty(3)
        ours = attempt(world.reduce_scatter, filled, inputs(rank, size), op=op)
        theirs = attempt(dist.reduce_scatter, expected, inputs(rank, size), op=getattr(dist.ReduceOp, op.upper()))
        seen[f"reduce_scatter_{op}"] = {
            "ours": filled.tolist() if ours is filled else ours, "filled": ours is filled,
            "torch": expected.tolist() if theirs is None else theirs,
        }  # fmt: skip
    outputs, expected = [torch.empty(3) for _ in range(size)], [torch.empty(3) for _ in range(size)]
    ours = attempt(world.all_to_all, outputs, inputs(rank, size))
    theirs = attempt(dist.all_to_all, expected, inputs(rank, size))
    seen["all_to_all"] = {
        "ours": [t.tolist() for t in outputs] if ours is outputs else ours, "filled": ours is outputs,
        "torch": [t.tolist() for t in expected] if theirs is None else theirs,
    }  # fmt: skip
    for dst in (0, 1):
        obj = {"rank": rank, "payload": [rank] * (rank + 1), "name": f"r{rank}"}
        ours = world.gather_object(obj, [None] * size if rank == dst else None, dst=dst)
        theirs = [None] * size if rank == dst else None
        dist.gather_object(obj, theirs, dst=dst)
        seen[f"gather_object_{dst}"] = {"ours": ours, "torch": theirs}
    # every rank arrives: returns None, like torch's
    seen["monitored_all_arrive"] = {
        "ours": world.monitored_barrier(timeout=timedelta(seconds=30)),
        "torch": dist.monitored_barrier(timeout=timedelta(seconds=30)),
    }
    # rank 1 is late (it never enters the monitored barrier): rank 0's ends within the timeout naming rank 1. gloo
    # closes a group's connections after that, so each side gets a fresh group of its own, and the ranks meet again
    # on the default group.
    late = {"ours": TorchCollective().create_group(), "torch": dist.new_group()}
    if rank == 0:
        for who, group in late.items():
            started = time.monotonic()
            try:
                if who == "ours":
                    group.monitored_barrier(timeout=timedelta(seconds=1))
                else:
                    dist.monitored_barrier(group=group, timeout=timedelta(seconds=1))
                error = None
            except Exception as err:  # what torch raises, as it raises it
                error = f"{type(err).__name__}: {err}"
            seen[f"monitored_late_{who}"] = {"error": error, "seconds": time.monotonic() - started}
        # the same message from both, but for the milliseconds waited
        errors = [re.sub(r"\d+ ?ms", "N ms", seen[f"monitored_late_{w}"]["error"] or "") for w in late]
        seen["monitored_same_error"] = errors[0] == errors[1]
    else:
        time.sleep(3.0)
    dist.barrier()  # the default group: untouched by the failed barriers
    late["ours"].teardown()
    dist.destroy_process_group(late["torch"])
    (out / f"reference{rank}.json").write_text(json.dumps(seen))
    world.teardown()
    seen_after = {"default_group_destroyed": not dist.is_initialized()}
    (out / f"reference{rank}.after.json").write_text(json.dumps(seen_after))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
