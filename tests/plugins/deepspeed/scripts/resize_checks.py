"""DeepSpeed checkpoints resumed on another number of ranks (2 -> 3 -> 1), optimizer state included.

``python resize_checks.py OUT PHASE`` on every rank, PHASE one of ``save`` (2 ranks), ``grow`` (3 ranks), ``shrink``
(1 rank); ``save`` and ``shrink`` run inside the jobs of ``checkpoint_checks.py save`` and ``load_elsewhere.py one``
(two starts of the processes fewer). Per configuration (ZeRO 2 and 3 in float32, ZeRO 3 in bf16-mixed), the elastic
recipe: a shuffled ``StatefulDataLoader`` with ``global_batch_size=6`` (one global order, each rank its share),
``RandomStates``, the sample ledger. ``save`` trains 3 steps, saves, and trains on to the end of the epoch (the
uninterrupted run, whose last 4 steps the ledger rolls back at the next resume); ``grow`` and ``shrink`` load the
previous phase's checkpoint into an engine built from other weights, gather the full state (float32 master weights,
the module's weights and buffers, a frozen parameter, every optimizer state tensor, step counters, the learning rate)
next to the state gathered before that save, and train 2 steps (the same global batches as the uninterrupted run);
``grow`` saves again, and converts its ZeRO-3 float32 checkpoint ahead as users of large checkpoints do, which
``shrink`` then loads without converting. ``grow`` also loads what cannot be resharded (an SGD-with-momentum
checkpoint, one saved with ``elastic_checkpoint``, another model, a corrupt partition file only the converter on local
rank 0 reads): a clear error on every rank, the model untouched, no scratch folder left behind. Writes ``resize_<phase>.json``, ``state_<config>_<phase>_{saved,loaded}.pt`` (rank 0)
and the ledgers ``ledger_<config>``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ds_common as c
import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from fabric_core import Fabric
from fabric_core.runtime.resume import RandomStates
from fabric_deepspeed import DeepSpeedStrategy, universal

CONFIGS = [("s2", 2, "32-true"), ("s3", 3, "32-true"), ("s3_bf16", 3, "bf16-mixed")]
PHASES = {"save": (2, None), "grow": (3, "save"), "shrink": (1, "grow")}
GLOBAL = 6  # samples per step (`global_batch_size`): 2, 3 and 1 ranks take equal shares
STEPS = 7  # one epoch of 42 samples


def loader(fabric: Fabric, out: Path, name: str):
    """The elastic recipe's loader: one global order of the samples, the position saved (world-size free), every
    sample a rank trains written to the ledger ``OUT/ledger_<name>``."""
    os.environ["FABRIC_SAMPLE_LEDGER"] = str(out / f"ledger_{name}")  # before the loader is set up
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(STEPS * GLOBAL, c.D_IN, generator=g), torch.randn(STEPS * GLOBAL, c.D_OUT, generator=g))
    return fabric.setup_dataloaders(StatefulDataLoader(data, batch_size=1, shuffle=True), global_batch_size=GLOBAL)


def build(fabric: Fabric, seed: int):
    model = c.make_model(seed)
    model.inp.bias.requires_grad_(False)  # a frozen parameter: not in the optimizer, not in the universal layout
    optimizer = c.make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    return fabric.setup(model, optimizer, scheduler=scheduler)


def full_state(fabric: Fabric, model) -> dict:
    """Everything a resume must bring back, gathered into full tensors on every rank (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = fabric.strategy.engines[-1]
    state = {f"module.{k}": v for k, v in c.full_params(fabric, model).items()}  # weights as the model holds them
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            state[f"fp32.{name}"] = safe_get_full_fp32_param(p).detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    base = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    state["optimizer_step"] = torch.tensor(sorted(steps))
    state["lr"] = torch.tensor([g["lr"] for g in base.param_groups])
    state["engine_steps"] = torch.tensor([engine.global_steps, engine.global_samples])
    return state


def train(fabric: Fabric, model, optimizer, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        loss = c.loss_fn(model(x), y)
        fabric.backward(loss, model=model)
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return losses


def unreshardable_checkpoints(out) -> None:
    """Stage-2 checkpoints for the grow phase to refuse: SGD with momentum (state ``momentum_buffer``, which DeepSpeed's
    converter would drop) and Adam saved with ZeRO's ``elastic_checkpoint`` (a layout the converter does not read)."""
    elastic = copy.deepcopy(DeepSpeedStrategy(stage=2).config)  # the defaults, as a user's own config would hold them
    elastic["zero_optimization"]["elastic_checkpoint"] = True
    for name, config in (("ck_momentum", None), ("ck_elastic", elastic)):
        fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2, config=config), devices=2)
        fabric.launch()
        model = c.make_model(0)
        optimizer = c.make_optimizer(model) if config else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        optimizer.zero_grad()
        fabric.backward(model(torch.ones(2, c.D_IN)).square().mean())
        optimizer.step()
        fabric.save(out / name, {"model": model, "optimizer": optimizer})


class Wider(c.Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(c.D_OUT, c.D_OUT)


def refusals(fabric: Fabric, model, optimizer, out) -> dict:
    """Loads that cannot reshard fail on every rank with what to do, before the model changes."""
    errors: dict[str, str] = {}
    before = c.full_params(fabric, model)
    state = {"model": model, "optimizer": optimizer}
    errors["momentum"] = c.expect_error(RuntimeError, "momentum_buffer", fabric.load, out / "ck_momentum", state)
    errors["elastic"] = c.expect_error(RuntimeError, "elastic_checkpoint", fabric.load, out / "ck_elastic", state)
    if fabric.global_rank == 0:  # a truncated partition: only the converter (local rank 0) reads it whole
        shutil.copytree(out / "ck_s2_save", out / "ck_corrupt")
        victim = out / "ck_corrupt" / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        victim.write_bytes(victim.read_bytes()[:200])
    fabric.barrier()
    errors["corrupt"] = c.expect_error(RuntimeError, "universal layout", fabric.load, out / "ck_corrupt", state, weights_only=False)
    unchanged = c.max_diff(before, c.full_params(fabric, model)) == 0.0
    wider = Wider()
    wider, wider_optimizer = fabric.setup(wider, c.make_optimizer(wider))
    errors["other_model"] = c.expect_error(
        KeyError, "extra.weight", fabric.load, out / "ck_s2_save", {"model": wider, "optimizer": wider_optimizer}
    )
    return {"errors": errors, "unchanged": unchanged}


def run_phase(out: Path, phase: str) -> None:
    """One phase on this rank (``checkpoint_checks.py save`` and ``load_elsewhere.py one`` run theirs in their jobs)."""
    world, previous = PHASES[phase]
    scratch = out / f"tmp_{phase}_{os.environ['RANK']}"  # the system temporary folder, where converted checkpoints go
    scratch.mkdir(exist_ok=True)
    tempfile.tempdir, system_tmp = str(scratch), tempfile.tempdir
    try:
        _run(out, phase, world, previous)
    finally:
        tempfile.tempdir = system_tmp


def convert_ahead(checkpoint: Path) -> None:
    """What the README tells users with large checkpoints to do: DeepSpeed's converter into a folder of the checkpoint
    (its command line ``python -m deepspeed.checkpoint.ds_to_universal`` with these arguments; here in-process)."""
    from deepspeed.checkpoint.ds_to_universal import main

    folders = {"input_folder": str(checkpoint / "checkpoint"), "output_folder": str(checkpoint / "checkpoint_universal")}
    options = {"num_extract_workers": 1, "num_merge_workers": 1, "keep_temp_folder": False, "strict": True}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(argparse.Namespace(**folders, **options, inject_missing_state=True))


def _run(out: Path, phase: str, world: int, previous: str | None) -> None:
    result: dict = {}
    conversions: list[str] = []  # which loads converted (the one converted ahead must not)
    convert = universal.convert_to_universal
    universal.convert_to_universal = lambda path, tag, dest: (conversions.append(path.name), convert(path, tag, dest))[1]
    for name, stage, precision in CONFIGS:
        c.mark(f"{phase} {name}")
        fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=stage), devices=world, precision=precision)
        fabric.launch()
        record: dict = {}
        data = loader(fabric, out, name)
        if previous is None:
            model, optimizer, scheduler = build(fabric, seed=0)
            with torch.no_grad():
                model.module.offset.add_(0.25)  # a buffer that differs from a fresh model's
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": data, "rng": RandomStates(fabric)}
            batches = iter(data)
            record["losses"] = train(fabric, model, optimizer, batches, 3)
            state["step"] = 3
        else:
            model, optimizer, scheduler = build(fabric, seed=11)
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": data, "rng": RandomStates(fabric), "step": 0}
            remainder = fabric.load(out / f"ck_{name}_{previous}", state)
            record.update(remainder=sorted(remainder), step=state["step"])
            with torch.random.fork_rng(devices=[]):  # what each rank's generator draws next
                record["draws"] = fabric.all_gather(torch.rand(1, dtype=torch.float64)).flatten().tolist()
            loaded = full_state(fabric, model)
            if fabric.global_rank == 0:
                torch.save(loaded, out / f"state_{name}_{phase}_loaded.pt")
            batches = iter(data)  # the rest of the epoch, from the saved global position
            record["losses"] = train(fabric, model, optimizer, batches, 2)
            state["step"] += 2
        if phase != "shrink":
            saved = full_state(fabric, model)
            if fabric.global_rank == 0:
                torch.save(saved, out / f"state_{name}_{phase}_saved.pt")
            fabric.save(out / f"ck_{name}_{phase}", state)
        if phase == "grow" and name == "s3" and fabric.global_rank == 0:
            convert_ahead(out / f"ck_{name}_{phase}")  # the shrink phase loads it without converting
        if phase == "save":  # the uninterrupted run's next steps, for the resumed ones to match (then rolled back)
            record["after"] = train(fabric, model, optimizer, batches, STEPS - state["step"])
        record["world"] = fabric.world_size
        if name == "s2" and phase == "save":
            unreshardable_checkpoints(out)
        if name == "s2" and phase == "grow":
            record["refusals"] = refusals(fabric, model, optimizer, out)
        result[name] = record
    result["conversions"] = conversions
    result["scratch_left"] = sorted(p.name for p in Path(tempfile.tempdir).glob("fabric-deepspeed-universal-*"))
    if fabric.global_rank == 0:
        c.dump(out / f"resize_{phase}.json", result)


if __name__ == "__main__":
    run_phase(c.out_dir(), sys.argv[2])
