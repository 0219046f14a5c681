"""``with fabric.profile(...) as prof:``: ``torch.profiler`` on every rank, traces per rank, a rank-zero summary.

Wrap any part of the loop. Each rank profiles itself and writes its traces to ``<dirpath>/rank<r>/`` (Chrome/Perfetto
traces that TensorBoard's profiler plugin and ui.perfetto.dev open), so a slow rank can be told from the others.
When the block ends, global rank 0 prints a table of the operators that took the most time (``row_limit`` rows,
sorted by ``sort_by``) and writes it to ``<dirpath>/summary-rank0.txt``.

With ``schedule=`` (a ``torch.profiler.schedule`` or a dict of its arguments: ``wait``, ``warmup``, ``active``,
``repeat``, ``skip_first``), call ``prof.step()`` once per iteration and only the active steps are recorded; each
finished cycle writes a trace, and the summary covers every recorded step of every cycle (torch's profiler drops a
cycle's events when the next begins unless asked to keep them: a loop whose length is a multiple of the cycle would
otherwise get an empty table). Without it, the whole block is one trace.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["profile"]


def _schedule(schedule: Any) -> Callable[[int], Any] | None:
    from torch.profiler import schedule as make_schedule

    if schedule is None or callable(schedule):
        return schedule
    if isinstance(schedule, Mapping):
        try:
            return make_schedule(**{"wait": 0, "warmup": 0, **schedule})
        except TypeError as err:
            raise TypeError(
                f"`fabric.profile(schedule={dict(schedule)!r})`: {err}. Its keys are those of `torch.profiler.schedule`:"
                " wait, warmup, active, repeat, skip_first."
            ) from None
    raise TypeError(
        f"`fabric.profile(schedule=...)` takes a `torch.profiler.schedule(...)` or a dict of its arguments, got a"
        f" {type(schedule).__name__}."
    )


@contextmanager
def profile(
    fabric: Any,
    dirpath: str | os.PathLike = "fabric_profile",
    *,
    schedule: Any = None,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    sort_by: str | None = None,
    row_limit: int = 20,
) -> Generator[Any, None, None]:
    """Profile the block on every rank; yields the ``torch.profiler.profile`` (call ``.step()`` with a schedule)."""
    from torch.profiler import ProfilerActivity, tensorboard_trace_handler
    from torch.profiler import profile as torch_profile

    rank = fabric.global_rank
    folder = Path(dirpath) / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if fabric.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    scheduled = _schedule(schedule)
    handler = tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}") if scheduled is not None else None
    with torch_profile(
        activities=activities,
        schedule=scheduled,
        on_trace_ready=handler,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
        acc_events=scheduled is not None,  # the summary covers every cycle, not only the one open at the end
    ) as prof:
        yield prof
    if scheduled is None:
        prof.export_chrome_trace(str(folder / f"rank{rank}.pt.trace.json"))
    if rank == 0:
        key = sort_by or ("cuda_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total")
        events = prof.key_averages()
        table = events.table(sort_by=key, row_limit=row_limit) if len(events) else ""
        if not table.strip():
            table = "No step was recorded: the block ended before the schedule's first active step.\n"
        (Path(dirpath) / "summary-rank0.txt").write_text(table)
        print(table)
