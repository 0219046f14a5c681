"""Training-loop throughput: the same loop written in raw PyTorch, with fabric-core, and with lightning-fabric.

All variants live in one process (the section is isolated: the harness runs it in a fresh interpreter), start
from identical weights, and take turns in short rounds of k steps (A B C, B C A, ...). Each repetition gives one
steps/s per variant; ratios and "µs added per step" are computed within a repetition, then summarised.

The raw loop is written out by hand (no helper indirection) so it is the fastest honest baseline. The optional
phase breakdown times data / forward / loss / backward / step / zero_grad separately, to show where added time
goes.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import LIGHTNING, OURS, RAW, paired_ratios, rotated, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

# torch is imported inside the functions: the harness reads this module's SECTION without importing torch.

#: The block clock. ``process_time`` (CPU seconds of this process) by default: with one intra-op thread it is the
#: wall time an idle machine would show, minus what other processes on a shared machine steal. ``--clock wall``
#: switches to ``perf_counter`` (for the blocks and the phase breakdown alike).
perf_counter = time.perf_counter
clock = time.process_time

#: case name -> (model kind, uses a DataLoader, batch size)
CASES: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": "tiny",
        "dataloader": False,
        "batch": 16,
        "description": "Linear(32,32)-ReLU-Linear(32,2), batch 16, SGD",
    },
    "tiny_dataloader": {
        "model": "tiny",
        "dataloader": True,
        "batch": 16,
        "description": "same, batches from a DataLoader over a TensorDataset (num_workers=0, shuffle)",
    },
    "mlp": {
        "model": "mlp",
        "dataloader": False,
        "batch": 64,
        "description": "3 x Linear(512,512) with ReLU, batch 64, SGD",
    },
}


def build_model(kind: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "tiny":
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
        )
    raise ValueError(kind)


def make_data(kind: str, batch: int, n_batches: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    n = batch * n_batches
    if kind == "tiny":
        return torch.randn(n, 32, generator=g), torch.randint(0, 2, (n,), generator=g)
    return torch.randn(n, 512, generator=g), torch.randn(n, 512, generator=g)


def loss_fn(kind: str) -> Callable[[Any, Any], Any]:
    import torch.nn.functional as F

    return F.cross_entropy if kind == "tiny" else F.mse_loss


# ------------------------------------------------------------------------------------------------ loops
# The loops are duplicated on purpose: the raw one must not pay for an indirection the others need.
def raw_fixed(model: Any, opt: Any, x: Any, y: Any, n: int, lf: Callable) -> float:
    t0 = clock()
    for _ in range(n):
        loss = lf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return clock() - t0


def fabric_fixed(fabric: Any, model: Any, opt: Any, x: Any, y: Any, n: int, lf: Callable) -> float:
    t0 = clock()
    for _ in range(n):
        loss = lf(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return clock() - t0


class _Epochs:
    """An endless stream of batches: a new epoch (``iter(loader)``) starts where the last one ended."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it = iter(loader)


def raw_loader(model: Any, opt: Any, data: _Epochs, n: int, lf: Callable) -> float:
    it = data.it
    t0 = clock()
    for _ in range(n):
        try:
            x, y = next(it)
        except StopIteration:
            it = data.it = iter(data.loader)
            x, y = next(it)
        loss = lf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return clock() - t0


def fabric_loader(fabric: Any, model: Any, opt: Any, data: _Epochs, n: int, lf: Callable) -> float:
    it = data.it
    t0 = clock()
    for _ in range(n):
        try:
            x, y = next(it)
        except StopIteration:
            it = data.it = iter(data.loader)
            x, y = next(it)
        loss = lf(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return clock() - t0


PHASES = ("data", "forward", "loss", "backward", "step", "zero_grad")


def phases_loop(
    fabric: Any, model: Any, opt: Any, data: _Epochs | None, xy: Any, n: int, lf: Callable
) -> dict[str, float]:
    """``n`` steps with each phase timed separately; seconds per step for each phase."""
    acc = dict.fromkeys(PHASES, 0.0)
    for _ in range(n):
        t0 = clock()
        if data is not None:
            try:
                x, y = next(data.it)
            except StopIteration:
                data.it = iter(data.loader)
                x, y = next(data.it)
        else:
            x, y = xy
        t1 = clock()
        out = model(x)
        t2 = clock()
        loss = lf(out, y)
        t3 = clock()
        if fabric is None:
            loss.backward()
        else:
            fabric.backward(loss)
        t4 = clock()
        opt.step()
        t5 = clock()
        opt.zero_grad()
        t6 = clock()
        acc["data"] += t1 - t0
        acc["forward"] += t2 - t1
        acc["loss"] += t3 - t2
        acc["backward"] += t4 - t3
        acc["step"] += t5 - t4
        acc["zero_grad"] += t6 - t5
    return {k: v / n for k, v in acc.items()}


# ------------------------------------------------------------------------------------------------ variants
def make_fabric(variant: str) -> Any:
    if variant == RAW:
        return None
    if variant == OURS:
        from fabric_core import Fabric
    else:
        from lightning_fabric import Fabric
    return Fabric(accelerator="cpu", devices=1)


class Runner:
    """One variant of one case: its own model copy, optimizer and data, ready to run a few steps at a time."""

    def __init__(self, variant: str, case: dict[str, Any], epoch_batches: int) -> None:
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        self.variant = variant
        self.case = case
        kind = case["model"]
        self.lf = loss_fn(kind)
        model = build_model(kind)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = make_data(kind, case["batch"], epoch_batches)
        self.fabric = make_fabric(variant)
        if self.fabric is not None:
            model, opt = self.fabric.setup(model, opt)
        self.model, self.opt = model, opt
        self.data: _Epochs | None = None
        if case["dataloader"]:
            loader: Any = DataLoader(TensorDataset(x, y), batch_size=case["batch"], shuffle=True)
            if self.fabric is not None:
                loader = self.fabric.setup_dataloaders(loader)
            self.data = _Epochs(loader)
        self.x, self.y = x[: case["batch"]], y[: case["batch"]]

    def run(self, n: int) -> float:
        """Run ``n`` training steps; return the seconds they took."""
        if self.data is not None:
            if self.fabric is None:
                return raw_loader(self.model, self.opt, self.data, n, self.lf)
            return fabric_loader(self.fabric, self.model, self.opt, self.data, n, self.lf)
        if self.fabric is None:
            return raw_fixed(self.model, self.opt, self.x, self.y, n, self.lf)
        return fabric_fixed(self.fabric, self.model, self.opt, self.x, self.y, n, self.lf)

    def phases(self, n: int) -> dict[str, float]:
        return phases_loop(self.fabric, self.model, self.opt, self.data, (self.x, self.y), n, self.lf)


def run_case(name: str, cfg: Any, variants: list[str]) -> dict[str, Any]:
    """Interleave the variants in rounds of ``k`` steps each; a repetition is ``rounds`` such rounds.

    Rounds are short (a few ms), so the two members of a pair see nearly the same machine; within a repetition
    the median round of each variant gives its steps/s, which ignores the odd round in which the process was
    preempted. Ratios and µs added are taken per repetition, then summarised over repetitions.
    """
    case = CASES[name]
    k = cfg["round_steps"][name]
    rounds, reps = cfg["rounds"], cfg["steps_reps"]
    runners = {v: Runner(v, case, cfg.get("epoch_batches", 64)) for v in variants}
    for r in runners.values():  # warm-up: optimizer state, allocator, caches
        r.run(max(k, 5))
    per_rep: dict[str, list[float]] = {v: [] for v in variants}  # median seconds per step, one per repetition
    for rep in range(reps):
        round_times: dict[str, list[float]] = {v: [] for v in variants}
        gc.collect()
        for rnd in range(rounds):
            for v in rotated(variants, rep * rounds + rnd):
                round_times[v].append(runners[v].run(k))
        for v in variants:
            per_rep[v].append(statistics.median(round_times[v]) / k)
    out: dict[str, Any] = {
        "description": case["description"],
        "round_steps": k,
        "rounds_per_rep": rounds,
        "reps": reps,
        "variants": {},
        "ratios": {},
        "us_added_per_step": {},
    }
    for v in variants:
        out["variants"][v] = {
            "steps_per_s": summarize([1 / t for t in per_rep[v]]),
            "us_per_step": summarize([1e6 * t for t in per_rep[v]]),
        }
        if v != RAW:
            out["ratios"][v] = paired_ratios([1 / t for t in per_rep[v]], [1 / t for t in per_rep[RAW]])
            out["us_added_per_step"][v] = summarize([1e6 * (a - b) for a, b in zip(per_rep[v], per_rep[RAW])])
    if cfg.get("phases"):
        samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for rnd in range(rounds * reps):
            for v in rotated(variants, rnd):
                samples[v].append(runners[v].phases(k))
        out["phases_us"] = {
            v: {p: 1e6 * statistics.median(s[p] for s in samples[v]) for p in PHASES} for v in variants
        }
        out["phases_us_added"] = {
            v: {p: out["phases_us"][v][p] - out["phases_us"][RAW][p] for p in PHASES}
            for v in variants
            if v != RAW
        }
    return out


def run(ctx: RunContext) -> dict[str, Any]:
    import torch

    global clock
    clock = time.perf_counter if ctx.options.get("clock") == "wall" else time.process_time
    if ctx.options.get("threads"):
        torch.set_num_threads(int(ctx.options["threads"]))
    variants = list(ctx.variants)
    if LIGHTNING in variants:
        import lightning_fabric  # noqa: F401  (imported up front: every variant then runs in the same process state)
    result: dict[str, Any] = {
        "status": "ok",
        "threads": torch.get_num_threads(),
        "clock": "wall" if clock is time.perf_counter else "process_cpu",
        "cases": {},
    }
    for name in ctx.config["cases"]:
        result["cases"][name] = run_case(name, ctx.config, variants)
    return result


def render(st: dict[str, Any], ctx: RenderContext) -> str:
    lines = [f"### Training loop, one process ({st['threads']} intra-op thread(s), clock: {st['clock']})", ""]
    header = ["case", "raw steps/s", "ours steps/s", "ours ratio", "ours µs added/step"]
    if ctx.lightning:
        header += ["lightning steps/s", "lightning ratio", "lightning µs added/step"]
    rows = []
    for name, c in st["cases"].items():
        row = [
            f"{name}: {c['description']}",
            stat(c["variants"][RAW]["steps_per_s"]),
            stat(c["variants"][OURS]["steps_per_s"]),
            stat(c["ratios"][OURS]),
            stat(c["us_added_per_step"][OURS], fixed=1),
        ]
        if ctx.lightning and LIGHTNING in c["variants"]:
            row += [
                stat(c["variants"][LIGHTNING]["steps_per_s"]),
                stat(c["ratios"][LIGHTNING]),
                stat(c["us_added_per_step"][LIGHTNING], fixed=1),
            ]
        rows.append(row)
    lines += [*table(header, rows), ""]
    if any("phases_us_added" in c for c in st["cases"].values()):
        lines += ["Where the added time goes (median µs per step added to each phase, vs the raw loop):", ""]
        rows = []
        for name, c in st["cases"].items():
            for v, added in c.get("phases_us_added", {}).items():
                rows.append([name, v] + [f"{added[p]:+.1f}" for p in PHASES])
        lines += table(["case", "variant", *PHASES], rows)
    return "\n".join(lines)


SECTION = Section(
    name="steps",
    order=20,
    isolated=True,
    timeout_s=1800,
    modes={
        "full": {
            "cases": ["tiny", "tiny_dataloader", "mlp"],
            "round_steps": {"tiny": 10, "tiny_dataloader": 10, "mlp": 2},
            "rounds": 40,
            "steps_reps": 7,
            "phases": True,
        },
        "quick": {
            "cases": ["tiny", "tiny_dataloader", "mlp"],
            "round_steps": {"tiny": 10, "tiny_dataloader": 10, "mlp": 2},
            "rounds": 10,
            "steps_reps": 3,
            "phases": False,
        },
        "tiny": {
            "cases": ["tiny", "tiny_dataloader", "mlp"],
            "round_steps": {"tiny": 2, "tiny_dataloader": 2, "mlp": 1},
            "rounds": 2,
            "steps_reps": 2,
            "phases": True,
        },
    },
    run=run,
    render=render,
    targets=(
        Target(
            "steps_tiny",
            "steps/s, tiny model, fixed batch / raw loop",
            ("cases", "tiny", "ratios"),
            ">=",
            0.98,
        ),
        Target(
            "steps_tiny_dataloader",
            "steps/s, tiny model with DataLoader / raw loop",
            ("cases", "tiny_dataloader", "ratios"),
            ">=",
            0.98,
        ),
        Target("steps_mlp", "steps/s, 3x512 MLP / raw loop", ("cases", "mlp", "ratios"), ">=", 0.99),
    ),
)
