"""Worker of the ``tiers`` benchmark section (``benchmarks/sections/tiers.py``); one command per measurement.

    python tiers_worker.py steps OUT STATE_MIB BATCH STEPS REPS      # snapshot cost and saves in flight
    python tiers_worker.py lost OUT VARIANT KILL_AFTER_S             # a run SIGKILLed at a random moment, or resumed
    python tiers_worker.py compile OUT CACHE_DIR ARTIFACTS MODE      # first compiled step: cold, artifacts, warm
    fabric run ... tiers_worker.py recover OUT                       # kill -> next step (started by the section)

``steps`` runs one process (or every rank of a torchrun job); its model is an MLP of 2048-wide layers whose
parameters and AdamW states make about STATE_MIB; the training thread is alone (``torch.set_num_threads(1)``), the
other core is free for the snapshot thread and the keeper. It emits, for each variant, every step's seconds.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import emit  # noqa: E402

torch.set_num_threads(1)


def build(state_mib: float, seed: int = 0) -> tuple[nn.Module, int]:
    """An MLP whose parameters and AdamW states take about ``state_mib`` MiB (3 floats per parameter)."""
    parameters = state_mib * 2**20 / 12
    width = 2048 if state_mib >= 256 else 256
    layers = max(2, round(parameters / (width * width + width)))
    torch.manual_seed(seed)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    return model, width


def state_mib_of(model: nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) * 12 / 2**20


def _step(fabric, model, optimizer, x) -> None:
    loss = model(x).float().pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    fabric.backward(loss)
    optimizer.step()


# ------------------------------------------------------------------------------------------------------ steps
def steps(out: Path, state_mib: float, batch: int, n: int, reps: int) -> None:
    from fabric_core import Fabric

    if os.environ.get("FABRIC_CLI_USED"):
        fabric = Fabric()
    elif "LOCAL_RANK" in os.environ:  # torchrun: one rank of a ddp job
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ["WORLD_SIZE"]))
        fabric.launch()
    else:
        fabric = Fabric(accelerator="cpu", devices=1)
    model, width = build(state_mib)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(batch, width)
    state = {"model": model, "optimizer": optimizer}
    step = 0

    def timed(count: int, save=None) -> list[float]:
        nonlocal step
        times = []
        for _ in range(count):
            started = time.perf_counter()
            _step(fabric, model, optimizer, x)
            step += 1
            if save is not None:
                save(step)
            times.append(time.perf_counter() - started)
        return times

    for _ in range(2):  # warm-up: allocator, first AdamW step (its states appear)
        timed(1)
    memory = fabric.checkpoint_tiers(
        memory_every=1, memory_keep_last=1, disk=None, peer_copies=False, preemption=False
    )
    disk_dir = out / f"ckpts-{fabric.global_rank}"
    result: dict = {"state_mib": state_mib_of(model), "world_size": fabric.world_size, "snapshot": {"off": [], "memory": []},
                    "inflight": {"none": [], "thread": [], "process": []}, "save_call_s": {"thread": [], "process": []},
                    "save_total_s": {"thread": [], "process": []}, "steps_in_flight": {"thread": [], "process": []},
                    "snapshot_call_s": [], "snapshot_blocks": [], "inflight_blocks": []}  # fmt: skip

    # snapshot every step vs none, in interleaved blocks
    snapshot = lambda s: memory.save(s, state)  # noqa: E731
    timed(2, snapshot)  # first snapshots allocate their shared memory
    memory.wait()
    for rep in range(reps):
        block = {}  # each rep's medians: a ratio of neighbours in time (this VM's speed drifts over seconds)
        for variant in ("off", "memory") if rep % 2 == 0 else ("memory", "off"):
            if variant == "memory":
                times = timed(n, snapshot)
                result["snapshot_call_s"].append(memory.stats.get("last_snapshot_call_s"))
            else:
                times = timed(n)
            memory.wait()
            result["snapshot"][variant].extend(times[1:])
            block[variant] = statistics.median(times[1:])
        result["snapshot_blocks"].append(block)
    # not `finished`: that ends the node's keeper, and the tiers below would register with it while it exits
    memory.close(finished=False)
    process = fabric.checkpoint_tiers(
        memory_every=None,
        disk=str(out / "tiers" / "step-*.ckpt"),
        disk_every=1,
        disk_keep_last=1,
        preemption=False,
    )

    # one save of the whole state in flight: today's thread-based async_save vs the keeper's process
    def thread_save(s: int):
        return fabric.save(disk_dir / "step.ckpt", state, async_save=True)

    class _ProcessSave:
        """The disk tier's handle is done once the keeper wrote the file; waiting finishes the snapshot first (it is
        copied while the next steps run: the disk handle alone would wait for a step that never comes)."""

        def __init__(self, s: int) -> None:
            self.save = process.save(s, state)

        def done(self) -> bool:
            return self.save.handles["disk"].done()

        def wait(self) -> None:
            self.save.wait()

    process_save = _ProcessSave

    savers = {"thread": thread_save, "process": process_save}
    for save in savers.values():  # warm-up: snapshot buffers, the keeper's first torch import
        save(step).wait()
    for rep in range(reps):
        order = ["none", "thread", "process"]
        order = order[rep % 3 :] + order[: rep % 3]
        block = {}
        for variant in order:
            if variant == "none":
                times = timed(n)
                result["inflight"]["none"].extend(times)
                block["none"] = statistics.median(times)
                continue
            started = time.perf_counter()
            handle = savers[variant](step)
            result["save_call_s"][variant].append(time.perf_counter() - started)
            flying = []
            if fabric.world_size == 1:
                while not handle.done() and len(flying) < 3 * n:
                    flying.extend(timed(1))
            else:  # every rank takes the same steps (ddp); rank 0 (which writes) keeps those its save overlapped
                for _ in range(n):
                    busy = not handle.done()
                    took = timed(1)
                    if busy:
                        flying.extend(took)
            handle.wait()
            result["save_total_s"][variant].append(time.perf_counter() - started)
            result["steps_in_flight"][variant].append(len(flying))
            result["inflight"][variant].extend(flying)
            block[variant] = statistics.median(flying) if flying else None
            fabric.barrier()
        result["inflight_blocks"].append(block)
    process.close(finished=True)
    if fabric.global_rank == 0:
        emit(result)


# ------------------------------------------------------------------------------------------------------ lost
def lost(out: Path, variant: str, kill_after: float) -> None:
    """Train a small model; SIGKILL this process ``kill_after`` seconds in (0: resume only, report and exit)."""
    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, run_dir=out / "run")
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    series = out / "run" / "disk" / "step-*.ckpt"
    if variant == "memory":
        tiers = fabric.checkpoint_tiers(memory_every=1, disk=None, preemption=False)
        latest = fabric.latest_checkpoint(tiers)
    else:
        tiers = None
        latest = fabric.latest_checkpoint(series)
    if latest is not None:
        fabric.load(latest, state)
    if kill_after <= 0:
        if tiers is not None:
            tiers.close(finished=True)
        emit({"resumed": state["step"], "from": latest})
        return
    progress = open(out / "progress", "a")  # noqa: SIM115
    threading.Timer(kill_after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    x = torch.randn(32, 256)
    while True:
        _step(fabric, model, optimizer, x)
        state["step"] += 1
        if tiers is not None:
            tiers.save(state["step"], state)
        elif state["step"] % 50 == 0:
            fabric.save(str(series).replace("*", f"{state['step']:09d}"), state)
        progress.write(f"{state['step']}\n")
        progress.flush()


# ------------------------------------------------------------------------------------------------------ compile
def compile_first_step(out: Path, cache_dir: str, artifacts: str, mode: str) -> None:
    """Seconds to the end of the first compiled training step in a fresh process whose inductor cache is
    ``cache_dir``; ``mode``: ``cold`` (then save the artifacts), ``artifacts`` (load them first), ``warm``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from fabric_core.runtime import compile_cache

    started = time.perf_counter()
    restored = compile_cache.restore(Path(artifacts), 0) if mode == "artifacts" else False
    restore_s = time.perf_counter() - started
    model, width = build(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    x = torch.randn(16, width)
    started = time.perf_counter()
    loss = compiled(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    first = time.perf_counter() - started
    stored = compile_cache.store(Path(artifacts), 0) if mode == "cold" else 0
    emit(
        {
            "mode": mode,
            "first_step_s": first,
            "restore_s": restore_s,
            "restored": restored,
            "artifact_bytes": stored,
        }
    )


# ------------------------------------------------------------------------------------------------------ recover
def touch(model: nn.Module, optimizer) -> None:
    """Read and write every byte of the model's and the optimizer's tensors, values unchanged (``x * 1``): what the
    first step would do to them, so that each tier pays its reading here (a memory-mapped disk load reads a page at its
    first touch and copies it at its first write) and the first step keeps only what every restart pays."""
    with torch.no_grad():
        tensors = list(model.state_dict().values())
        tensors += [v for s in optimizer.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if tensor.is_floating_point() and tensor.numel():
                tensor.mul_(1)


def recover(out: Path) -> None:
    """Under ``fabric run`` agents: train to step ``TB_KILL_AT`` (saving it in memory with its peer copy, or on
    disk), park for the section to kill a node, then (restarted) resume and take ``TB_AFTER`` steps. Rank 0 writes
    when each phase ended (wall clock) to ``timeline-<attempt>.jsonl``; every rank its reload seconds."""
    from fabric_core import Fabric
    from fabric_core.runtime.run import PROCESS_START_NS

    tier = os.environ["TB_TIER"]
    kill_at, after = int(os.environ["TB_KILL_AT"]), int(os.environ.get("TB_AFTER", "2"))
    node = os.environ["TB_NODE"]
    marks = {"process_start": PROCESS_START_NS / 1e9}
    fabric = Fabric()
    marks["fabric"] = time.time()
    model, width = build(float(os.environ["TB_STATE_MIB"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    marks["built"] = time.time()
    series = out / "run" / "checkpoints" / "step-*.ckpt"
    if tier == "memory":
        tiers = fabric.checkpoint_tiers(memory_every=1, memory_keep_last=1, disk=None, preemption=False)
        marks["tiers"] = time.time()
        latest = fabric.latest_checkpoint(tiers)
    else:
        tiers = None
        marks["tiers"] = time.time()
        latest = fabric.latest_checkpoint(series)
    marks["found"] = time.time()
    started = time.perf_counter()
    if latest is not None:
        fabric.load(latest, state)
    load_s = time.perf_counter() - started
    marks["loaded"] = time.time()
    touch(model, optimizer)
    fabric.barrier()  # every rank's state in memory (the first step waits for the slowest anyway)
    marks["touched"] = time.time()
    attempt = 0 if latest is None else 1
    with open(out / f"reload-{attempt}", "a") as f:
        f.write(
            json.dumps(
                {
                    "rank": fabric.global_rank,
                    "node": node,
                    "load_s": load_s,
                    "source": (tiers.recovery or {}).get("source") if tiers else latest,
                }
            )
            + "\n"
        )
    x = torch.randn(8, width)
    goal = kill_at if attempt == 0 else state["step"] + after
    step_ends = []
    while state["step"] < goal:
        _step(fabric, model, optimizer, x)
        state["step"] += 1
        if tiers is not None:
            tiers.save(state["step"], state)
        step_ends.append(time.time())
        if "first_step" not in marks:
            marks["first_step"] = step_ends[0]
    marks["step_ends"] = step_ends
    if attempt == 0:
        if tiers is not None:
            tiers.wait_replicated(kill_at, timeout=600)
        else:
            fabric.save(str(series).replace("*", f"{kill_at:09d}"), state)
        fabric.barrier()
        (out / "pids").mkdir(exist_ok=True)
        (out / "pids" / f"{node}-{fabric.local_rank}.json").write_text(
            json.dumps({"pid": os.getpid(), "keeper": tiers.keeper_pid if tiers else None, "node": node})
        )
        if node == os.environ["TB_VICTIM"]:
            time.sleep(3600)
        fabric.barrier()  # fails when the victims die
        time.sleep(3600)
    if fabric.global_rank == 0:
        with open(out / f"timeline-{attempt}.jsonl", "a") as f:
            f.write(
                json.dumps({**marks, "latest": latest, "recovery": tiers.recovery if tiers else None}) + "\n"
            )
    if tiers is not None:
        tiers.close(finished=True)


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if command == "steps":
        steps(out, float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif command == "lost":
        lost(out, sys.argv[3], float(sys.argv[4]))
    elif command == "compile":
        compile_first_step(out, sys.argv[3], sys.argv[4], sys.argv[5])
    elif command == "recover":
        recover(out)
    else:
        raise SystemExit(f"unknown command {command!r}")
