"""Checkpoint save and load of a large state: time and peak memory, ours vs ``torch.save``/``torch.load``.

Run by the harness as ``python -m benchmarks.bench_checkpoint CONFIG_JSON``. This process only imports the
libraries; every operation runs in a fresh forked child (no import cost, no allocator history), which builds
the state, resets the kernel's RSS high-water mark, runs the one operation and reports its time and the peak
RSS above the state it started with. Variants are interleaved and the order rotates every repetition.

Saves: ``torch.save`` (plain, not crash-safe: the comparison a user makes), ``torch.save`` into a temp file + fsync
+ rename by hand (what a careful user writes to be crash-safe), ``fabric.save`` (ours, crash-safe; durability
finishes in the background), ``fabric.save(async_save=True)`` (ours; the first asynchronous save of a process
allocates its snapshot buffers, the next ones reuse them: both are measured), and lightning-fabric's
``fabric.save``. For each: ``seconds`` is how long the call blocks the loop, ``total_seconds`` until the checkpoint
is durable at its path; the disk is synced before every save, so none pays for an earlier one's writeback. Loads (all read the same file, written by ``torch.save``, from a warm page
cache): ``torch.load`` (+ ``load_state_dict``), ``torch.load(mmap=True)`` (+ ``load_state_dict``),
``fabric.load`` (ours and lightning's), and our checkpoint I/O with ``mmap=True``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from benchmarks._common import LIGHTNING, OURS, RAW, emit, paired_ratios, reset_peak_rss, rotated, summarize

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


class Blob(nn.Module):
    """``size_mib`` of fp32 weights in 8 linear layers (1024 inputs each), like a slice of a big model."""

    def __init__(self, size_mib: int) -> None:
        super().__init__()
        rows = max(1, size_mib * 2**20 // (4 * 1024 * 8))
        self.layers = nn.ModuleList(nn.Linear(1024, rows, bias=False, device="meta") for _ in range(8))
        self.to_empty(device="cpu")
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.fill_(0.5 + i)  # touches every page, so the state is resident before we measure

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _fabric(variant: str) -> Any:
    if variant.startswith(OURS):
        from fabric_core import Fabric
    else:
        from lightning_fabric import Fabric
    return Fabric(accelerator="cpu", devices=1)


def _save(variant: str, fabric: Any, model: nn.Module, path: str) -> Any:
    """Run one save; returns what to wait for until it is durable (``None``: it already is)."""
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


def _load(variant: str, fabric: Any, model: nn.Module, path: str) -> tuple[float | None, Any]:
    """Run one load; returns (seconds to read the checkpoint, when measurable on its own; what stays alive)."""
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
        model = Blob(size_mib)
        # constructing Fabric is not part of the operation
        fabric = None if variant in (RAW, "raw_atomic", "raw_mmap") else _fabric(variant)
        if variant == "ours_async":  # the steady state: an earlier asynchronous save left its buffers
            fabric.save(path, {"model": model}, async_save=True).wait()
            os.unlink(path)
        gc.collect()
        reset_ok = reset_peak_rss()
        before = _status_kib()
        t0 = time.perf_counter()
        total = None
        if kind == "save":
            pending = _save(variant, fabric, model, path)
            seconds = time.perf_counter() - t0
            if pending is not None:
                pending.wait()
            total = time.perf_counter() - t0
            read, alive = None, None
        else:
            read, alive = _load(variant, fabric, model, path)
            seconds = time.perf_counter() - t0
        after = _status_kib()
        del alive
        conn.send(
            {
                "seconds": seconds,
                "total_seconds": total,
                "read_seconds": read,
                "state_mib": model.nbytes / 2**20,
                "extra_peak_mib": (after["VmHWM"] - before["VmRSS"]) / 1024 if reset_ok else None,
                "extra_anon_mib": (after["RssAnon"] - before["RssAnon"]) / 1024,
                "extra_file_mib": (after["RssFile"] - before["RssFile"]) / 1024,
                "hwm_reset": reset_ok,
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


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    size = int(cfg["ckpt_mib"])
    reps = int(cfg["ckpt_reps"])
    have_lightning = LIGHTNING in cfg["variants"]
    save_variants = [v for v in SAVE_VARIANTS if v != LIGHTNING or have_lightning]
    load_variants = [v for v in LOAD_VARIANTS if v != LIGHTNING or have_lightning]
    import fabric_core  # noqa: F401  (imported here once, so forked children start with it loaded)

    if have_lightning:
        import lightning_fabric  # noqa: F401
    folder = tempfile.mkdtemp(prefix="fabric-bench-ckpt-", dir=cfg.get("ckpt_dir") or None)
    saves: dict[str, list[dict[str, Any]]] = {v: [] for v in save_variants}
    loads: dict[str, list[dict[str, Any]]] = {v: [] for v in load_variants}
    try:
        for rep in range(reps):
            for v in rotated(save_variants, rep):
                path = os.path.join(folder, f"save-{v}.pt")
                os.sync()  # no writeback left over from the previous operation: each save starts alike
                saves[v].append(_run_op("save", v, size, path))
                os.unlink(path)
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
        v: paired_ratios(totals[v], totals["raw_atomic"]) for v in save_variants if v not in (RAW, "raw_atomic")
    }
    ratios["save_extra_peak_fraction"] = {
        v: summarize([r["extra_peak_mib"] / state_mib for r in saves[v] if r["extra_peak_mib"] is not None])
        for v in save_variants
    }
    ratios["load_time_vs_torch_load"] = {
        v: paired_ratios(secs["load", v], secs["load", RAW]) for v in load_variants if v != RAW
    }
    ratios["mmap_read_vs_torch_load_read"] = {
        v: paired_ratios([r["read_seconds"] for r in loads[v]], [r["read_seconds"] for r in loads[RAW]])
        for v in ("raw_mmap", "ours_mmap")
    }
    ratios["load_extra_peak_fraction"] = {
        v: summarize([r["extra_peak_mib"] / state_mib for r in loads[v] if r["extra_peak_mib"] is not None])
        for v in load_variants
    }
    return result


if __name__ == "__main__":
    emit(main(json.loads(sys.argv[1])))
