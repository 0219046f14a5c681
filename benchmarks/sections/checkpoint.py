"""Checkpoint save and load of a large state: time and peak memory, ours vs ``torch.save``/``torch.load``.

The section is isolated (the harness runs it in a fresh interpreter that only imports the libraries); every
operation then runs in a fresh forked child (no import cost, no allocator history), which builds the state,
resets the kernel's RSS high-water mark, runs the one operation and reports its time and the peak RSS above the
state it started with. Variants are interleaved and the order rotates every repetition.

Saves: ``torch.save`` (plain, not crash-safe: the comparison a user makes), ``torch.save`` into a temp file + fsync
+ rename by hand (what a careful user writes to be crash-safe), ``fabric.save`` (ours, crash-safe),
``fabric.save(async_save=True)`` (ours; the first asynchronous save of a process allocates its snapshot buffers,
the next ones reuse them: both are measured), and lightning-fabric's ``fabric.save``. For each: ``seconds`` is how
long the call blocks the loop, ``total_seconds`` until the checkpoint is durable at its path (``handle.wait()``);
the disk is synced before every save, so none pays for an earlier one's writeback. Every synchronous save is
checked the moment it returns: the complete checkpoint must be at ``path`` (the file exists, and after the wait it
has the same size and loads); a run where it is not is recorded as a failure and counts against the
``save_at_path`` target. Loads (all read the same file, written by ``torch.save``, from a warm page cache):
``torch.load`` (+ ``load_state_dict``), ``torch.load(mmap=True)`` (+ ``load_state_dict``), ``fabric.load`` (ours,
which maps the file, and lightning's), and our checkpoint I/O with ``mmap=True`` (read time alone).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

from benchmarks._common import LIGHTNING, OURS, RAW, paired_ratios, reset_peak_rss, rotated, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

# torch is imported inside the functions: the harness reads this module's SECTION without importing torch.

SAVE_VARIANTS = {
    RAW: "torch.save(state_dict, path)",
    "raw_atomic": "torch.save into a temp file, fsync, os.replace (crash-safe by hand)",
    OURS: "fabric.save(path, {'model': model})",
    "ours_async_first": "fabric.save(..., async_save=True), first in the process (allocates the snapshot)",
    "ours_async": "fabric.save(..., async_save=True), steady state (snapshot buffers reused)",
    LIGHTNING: "lightning_fabric fabric.save(path, {'model': model})",
}
LOAD_VARIANTS = {
    RAW: "torch.load(path) + model.load_state_dict",
    "raw_mmap": "torch.load(path, mmap=True) + model.load_state_dict",
    OURS: "fabric.load(path, {'model': model})",
    "ours_mmap": "fabric.strategy.checkpoint_io.load_checkpoint(path, mmap=True) + model.load_state_dict",
    LIGHTNING: "lightning_fabric fabric.load(path, {'model': model})",
}


def _status_kib() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1])
    return out


def blob(size_mib: int) -> Any:
    """``size_mib`` of fp32 weights in 8 linear layers (1024 inputs each), like a slice of a big model."""
    import torch
    from torch import nn

    rows = max(1, size_mib * 2**20 // (4 * 1024 * 8))
    model = nn.Sequential(*(nn.Linear(1024, rows, bias=False, device="meta") for _ in range(8)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.5 + i)  # touches every page, so the state is resident before we measure
    return model


def _nbytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _complete(path: str, model: Any) -> bool:
    """Whether ``path`` holds the whole checkpoint of ``model``: it loads, with every tensor's last value."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        saved = ckpt["model"]
        return all(torch.equal(saved[k][-1], v[-1]) for k, v in model.state_dict().items())
    except Exception:
        return False


def _fabric(variant: str) -> Any:
    if variant.startswith(OURS):
        from fabric_core import Fabric
    else:
        from lightning_fabric import Fabric
    return Fabric(accelerator="cpu", devices=1)


def _save(variant: str, fabric: Any, model: Any, path: str) -> Any:
    """Run one save; returns what to wait for until it is durable (``None``: it already is)."""
    import torch

    if variant == RAW:
        torch.save({"model": model.state_dict()}, path)
    elif variant == "raw_atomic":
        folder = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": model.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    elif variant.startswith("ours_async"):
        return fabric.save(path, {"model": model}, async_save=True)
    else:
        return fabric.save(path, {"model": model})
    return None


def _load(variant: str, fabric: Any, model: Any, path: str) -> tuple[float | None, Any]:
    """Run one load; returns (seconds to read the checkpoint, when measurable on its own; what stays alive)."""
    import torch

    if variant in (RAW, "raw_mmap"):
        t0 = time.perf_counter()
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=variant == "raw_mmap")
        read = time.perf_counter() - t0
        model.load_state_dict(ckpt["model"])
        return read, ckpt
    if variant == "ours_mmap":
        t0 = time.perf_counter()
        ckpt = fabric.strategy.checkpoint_io.load_checkpoint(path, mmap=True)
        read = time.perf_counter() - t0
        model.load_state_dict(ckpt["model"])
        return read, ckpt
    return None, fabric.load(path, {"model": model})


def _child(conn: Any, kind: str, variant: str, size_mib: int, path: str) -> None:
    try:
        model = blob(size_mib)
        # constructing Fabric is not part of the operation
        fabric = None if variant in (RAW, "raw_atomic", "raw_mmap") else _fabric(variant)
        if variant == "ours_async":  # the steady state: an earlier asynchronous save left its buffers
            fabric.save(path, {"model": model}, async_save=True).wait()
            os.unlink(path)
        gc.collect()
        reset_ok = reset_peak_rss()
        before = _status_kib()
        c0, t0 = time.process_time(), time.perf_counter()
        total = None
        checks: dict[str, Any] = {}
        if kind == "save":
            pending = _save(variant, fabric, model, path)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            # What holds the moment the call returned (an asynchronous save promises it only at wait()).
            size_on_return = os.path.getsize(path) if os.path.isfile(path) else None
            if pending is not None:
                pending.wait()
            total = time.perf_counter() - t0
            read, alive = None, None
        else:
            read, alive = _load(variant, fabric, model, path)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        after = _status_kib()
        del alive
        if kind == "save":  # checked after the memory was read: reading the file back must not count
            final_size = os.path.getsize(path) if os.path.isfile(path) else None
            checks = {
                "at_path_on_return": size_on_return is not None and size_on_return == final_size,
                "complete_after_wait": _complete(path, model),
            }
        conn.send(
            {
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "total_seconds": total,
                "read_seconds": read,
                "state_mib": _nbytes(model) / 2**20,
                "extra_peak_mib": (after["VmHWM"] - before["VmRSS"]) / 1024 if reset_ok else None,
                "extra_anon_mib": (after["RssAnon"] - before["RssAnon"]) / 1024,
                "extra_file_mib": (after["RssFile"] - before["RssFile"]) / 1024,
                "hwm_reset": reset_ok,
                **checks,
            }
        )
    except BaseException as err:  # report, so the harness can show what failed
        conn.send({"error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        conn.close()


def _run_op(kind: str, variant: str, size_mib: int, path: str) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, kind, variant, size_mib, path))
    proc.start()
    child.close()
    result = parent.recv() if parent.poll(600) else {"error": "timed out"}
    proc.join(60)
    if "error" in result:
        raise RuntimeError(f"checkpoint {kind} with {variant!r} failed: {result['error']}")
    return result


def run(ctx: RunContext) -> dict[str, Any]:
    size = int(ctx.config["state_mib"])
    reps = int(ctx.config["reps"])
    have_lightning = ctx.lightning
    save_variants = [v for v in SAVE_VARIANTS if v != LIGHTNING or have_lightning]
    load_variants = [v for v in LOAD_VARIANTS if v != LIGHTNING or have_lightning]
    import fabric_core  # noqa: F401  (imported here once, so forked children start with it loaded)

    blob(
        1
    )  # the first meta-device module imports ~1,400 torch modules (seconds): once here, not in every child

    if have_lightning:
        import lightning_fabric  # noqa: F401
    folder = tempfile.mkdtemp(prefix="fabric-bench-ckpt-", dir=ctx.options.get("ckpt_dir") or None)
    saves: dict[str, list[dict[str, Any]]] = {v: [] for v in save_variants}
    loads: dict[str, list[dict[str, Any]]] = {v: [] for v in load_variants}
    try:
        for rep in range(reps):
            for v in rotated(save_variants, rep):
                path = os.path.join(folder, f"save-{v}.pt")
                os.sync()  # no writeback left over from the previous operation: each save starts alike
                saves[v].append(_run_op("save", v, size, path))
                if os.path.exists(path):
                    os.unlink(path)
            ctx.log(
                f"  checkpoint rep {rep + 1}/{reps}: "
                + ", ".join(f"{v} {saves[v][-1]['seconds']:.3f} s" for v in save_variants)
            )
            common = os.path.join(folder, "state.pt")
            _run_op("save", RAW, size, common)
            for v in rotated(load_variants, rep):
                loads[v].append(_run_op("load", v, size, common))
            os.unlink(common)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    state_mib = saves[RAW][0]["state_mib"]

    def describe(samples: dict[str, list[dict[str, Any]]], names: dict[str, str]) -> dict[str, Any]:
        out = {}
        for v, rs in samples.items():
            entry = {
                "what": names[v],
                "seconds": summarize([r["seconds"] for r in rs]),
                "cpu_seconds": summarize([r["cpu_seconds"] for r in rs]),
                "extra_peak_mib": summarize(
                    [r["extra_peak_mib"] for r in rs if r["extra_peak_mib"] is not None]
                ),
                "extra_anon_mib": summarize([r["extra_anon_mib"] for r in rs]),
                "extra_file_mib": summarize([r["extra_file_mib"] for r in rs]),
            }
            if rs[0]["read_seconds"] is not None:
                entry["read_seconds"] = summarize([r["read_seconds"] for r in rs])
            if rs[0].get("total_seconds") is not None:
                entry["total_seconds"] = summarize([r["total_seconds"] for r in rs])
            out[v] = entry
        return out

    result: dict[str, Any] = {
        "status": "ok",
        "state_mib": state_mib,
        "reps": reps,
        "page_cache": "warm (loads read a file written just before)",
        "save": describe(saves, SAVE_VARIANTS),
        "load": describe(loads, LOAD_VARIANTS),
        "ratios": {},
    }
    secs = {("save", v): [r["seconds"] for r in saves[v]] for v in save_variants}
    secs |= {("load", v): [r["seconds"] for r in loads[v]] for v in load_variants}
    ratios = result["ratios"]
    ratios["save_time_vs_torch_save"] = {
        v: paired_ratios(secs["save", v], secs["save", RAW]) for v in save_variants if v != RAW
    }
    # The same calls in CPU seconds of the process (all its threads): on a machine shared with other work the
    # wall-clock time also counts the moments the call waited for a core; CPU time does not (nor does it count
    # waiting for the disk, so it is a cross-check, not the target).
    ratios["save_cpu_vs_torch_save"] = {
        v: paired_ratios([r["cpu_seconds"] for r in saves[v]], [r["cpu_seconds"] for r in saves[RAW]])
        for v in save_variants
        if v != RAW
    }
    ratios["save_time_vs_atomic_by_hand"] = {
        v: paired_ratios(secs["save", v], secs["save", "raw_atomic"])
        for v in (OURS, "ours_async_first", "ours_async", LIGHTNING)
        if v in save_variants
    }
    totals = {v: [r["total_seconds"] for r in saves[v]] for v in save_variants}
    ratios["save_total_time_vs_torch_save"] = {
        v: paired_ratios(totals[v], totals[RAW]) for v in save_variants if v != RAW
    }
    ratios["save_total_time_vs_atomic_by_hand"] = {
        v: paired_ratios(totals[v], totals["raw_atomic"])
        for v in save_variants
        if v not in (RAW, "raw_atomic")
    }
    ratios["save_extra_peak_fraction"] = {
        v: summarize([r["extra_peak_mib"] / state_mib for r in saves[v] if r["extra_peak_mib"] is not None])
        for v in save_variants
    }
    ratios["load_time_vs_torch_load"] = {
        v: paired_ratios(secs["load", v], secs["load", RAW]) for v in load_variants if v != RAW
    }
    # The floor of a memory-mapped load into an existing model: torch's own mmap load + load_state_dict, whose
    # copy of every tensor into the parameters no loader that keeps the model's own storage can skip.
    ratios["load_time_vs_torch_load_mmap"] = {
        v: paired_ratios(secs["load", v], secs["load", "raw_mmap"])
        for v in load_variants
        if v not in (RAW, "raw_mmap")
    }
    ratios["mmap_read_vs_torch_load_read"] = {
        v: paired_ratios([r["read_seconds"] for r in loads[v]], [r["read_seconds"] for r in loads[RAW]])
        for v in ("raw_mmap", "ours_mmap")
    }
    ratios["load_extra_peak_fraction"] = {
        v: summarize([r["extra_peak_mib"] / state_mib for r in loads[v] if r["extra_peak_mib"] is not None])
        for v in load_variants
    }
    # What held when each save returned: the complete checkpoint at `path` (synchronous saves promise it on return,
    # asynchronous ones at wait()), and after the wait, a checkpoint that loads with the state's values.
    on_return = [v for v in save_variants if not v.startswith("ours_async")]
    result["checks"] = {
        "at_path_on_return": {v: summarize([_fraction(saves[v], "at_path_on_return")]) for v in on_return},
        "complete_after_wait": {
            v: summarize([_fraction(saves[v], "complete_after_wait")]) for v in save_variants
        },
    }
    result["failures"] = [
        f"repetition {i + 1}, {v}: {what}"
        for v in save_variants
        for i, r in enumerate(saves[v])
        for key, what in (
            ("at_path_on_return", "the complete checkpoint was not at `path` when the call returned"),
            (
                "complete_after_wait",
                "the checkpoint at `path` did not load with the saved values after the wait",
            ),
        )
        if (key != "at_path_on_return" or v in on_return) and not r[key]
    ]
    return result


def _fraction(runs: list[dict[str, Any]], key: str) -> float:
    return sum(1 for r in runs if r[key]) / len(runs)


def render(ck: dict[str, Any], ctx: RenderContext) -> str:
    lines = [
        f"### Checkpoints: {ck['state_mib']:.0f} MiB state, {ck['reps']} repetition(s), page cache {ck['page_cache']}",
        "",
    ]
    rows = []
    ratios, checks = ck["ratios"], ck.get("checks", {})
    for v, e in ck["save"].items():
        ratio = ratios["save_time_vs_torch_save"].get(v)
        total_ratio = ratios.get("save_total_time_vs_torch_save", {}).get(v)
        atomic_ratio = ratios.get("save_time_vs_atomic_by_hand", {}).get(v)
        at_path = checks.get("at_path_on_return", {}).get(v)
        cpu_ratio = ratios.get("save_cpu_vs_torch_save", {}).get(v)
        rows.append(
            [
                v,
                e["what"],
                stat(e["seconds"]),
                stat(ratio) if v != RAW else "1",
                stat(e.get("cpu_seconds")),
                (stat(cpu_ratio) if cpu_ratio else "–") if v != RAW else "1",
                stat(atomic_ratio) if atomic_ratio else "–",
                f"{at_path['median']:.0%}" if at_path else "at wait()",
                stat(e.get("total_seconds")),
                stat(total_ratio) if v != RAW and total_ratio else "1" if v == RAW else "–",
                stat(e["extra_peak_mib"]),
                stat(ratios["save_extra_peak_fraction"].get(v), 2),
            ]
        )
    header = ["save", "what", "blocking s", "/ torch.save", "CPU s", "/ torch.save", "/ atomic by hand"]
    header.append("at `path` on return")
    lines += [*table([*header, "until durable s", "/ torch.save", "extra peak RSS MiB", "/ state"], rows), ""]
    lines.append(
        "`blocking s` is how long the call holds the training loop; `until durable s` until the checkpoint is"
        " fsync'd and at its path (for `torch.save` the two are the same: it never syncs). `CPU s`: the process's CPU"
        " time during the call (all threads): unlike the wall clock it leaves out the moments the call waited for a"
        " core on a busy machine (and for the disk), a cross-check of the blocking ratio. `at path on return`: the"
        " share of runs in which the complete checkpoint was at `path` the moment the call returned. The asynchronous"
        " snapshot costs one CPU copy of the state's tensors (the extra peak RSS above), kept and reused by the next"
        " asynchronous save."
    )
    lines.append("")
    if ck.get("failures"):
        lines += ["Failed checks:", "", *(f"- {f}" for f in ck["failures"]), ""]
    rows = []
    for v, e in ck["load"].items():
        rows.append(
            [
                v,
                e["what"],
                stat(e["seconds"]),
                stat(ratios["load_time_vs_torch_load"].get(v)) if v != RAW else "1",
                "1" if v == "raw_mmap" else stat(ratios.get("load_time_vs_torch_load_mmap", {}).get(v)),
                stat(e.get("read_seconds")),
                stat(e["extra_peak_mib"]),
                stat(e["extra_anon_mib"]),
            ]
        )
    header = ["load", "what", "total seconds", "/ torch.load", "/ torch.load(mmap)", "read seconds"]
    header.append("extra peak RSS MiB")
    lines += [*table([*header, "extra anon MiB at end"], rows), ""]
    lines.append(
        "Peak RSS counts file-backed pages too: a memory-mapped checkpoint whose tensors were copied into the model"
        ' shows up as resident file pages (page cache the kernel can drop), not as anonymous memory. "anon at'
        ' end" is taken while the loaded checkpoint is still referenced (`raw`, `raw_mmap`, `ours_mmap`); the'
        " `fabric.load` variants have already copied it into the model and let it go. `/ torch.load(mmap)`: over"
        " `torch.load(path, mmap=True)` + `load_state_dict`, the floor of a memory-mapped load into an existing"
        " model (the copy of every tensor into the parameters remains)."
    )
    return "\n".join(lines)


SECTION = Section(
    name="checkpoint",
    order=60,
    isolated=True,
    modes={
        # The figures: 512 MiB, at least 11 interleaved pairs.
        "full": {"state_mib": 512, "reps": 11},
        "quick": {"state_mib": 256, "reps": 1},
        "tiny": {"state_mib": 8, "reps": 1},
    },
    run=run,
    render=render,
    targets=(
        Target(
            "save_time",
            "`fabric.save` blocking time / `torch.save` (crash-safe vs not)",
            ("ratios", "save_time_vs_torch_save"),
            "<=",
            1.05,
        ),
        Target(
            "save_at_path",
            "`fabric.save`: share of runs with the complete checkpoint at `path` on return",
            ("checks", "at_path_on_return"),
            ">=",
            1.0,
        ),
        Target(
            "save_async",
            "`fabric.save(async_save=True)` blocking time / `torch.save` (steady state, state on CPU)",
            ("ratios", "save_time_vs_torch_save"),
            "<=",
            0.25,
            variant="ours_async",
            comparator=None,
        ),
        Target(
            "save_memory",
            "`fabric.save` extra peak RSS / state size",
            ("ratios", "save_extra_peak_fraction"),
            "<=",
            0.05,
        ),
        Target(
            "load_mmap",
            "`fabric.load` (memory-mapped) / `torch.load`, each + `load_state_dict`",
            ("ratios", "load_time_vs_torch_load"),
            "<=",
            0.2,
        ),
        Target(
            "load_mmap_read",
            "our mmap load (read) time / `torch.load` (read) time",
            ("ratios", "mmap_read_vs_torch_load_read"),
            "<=",
            0.2,
            variant="ours_mmap",
            comparator=None,
        ),
    ),
)
