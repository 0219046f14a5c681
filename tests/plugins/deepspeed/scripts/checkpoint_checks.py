"""DeepSpeed checkpoints on real ranks: save, continue, resume in fresh processes; bad inputs; load_raw.

``python checkpoint_checks.py OUT save`` then ``... OUT resume`` (fresh processes, other seeds) on every rank. The
save phase records the losses an uninterrupted run gets after the checkpoint; the resume phase must get the same.
The save phase then runs ``resize_checks.py``'s (checkpoints for 3 ranks to load).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ds_common as c
import resize_checks
import torch

from fabric_core import Fabric
from fabric_core.io.commit import is_temporary
from fabric_deepspeed import DeepSpeedStrategy

CONFIGS = [
    ("s1", 1, "32-true"),
    ("s2", 2, "32-true"),
    ("s3", 3, "32-true"),
    ("s2_bf16", 2, "bf16-mixed"),
    ("s3_bf16", 3, "bf16-mixed"),
]
BEFORE, AFTER = 4, 3


class Counter:
    """A stateful object of the user's: saved as client state through its state_dict."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def build(stage: int, precision: str, seed: int):
    fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=stage), devices=2, precision=precision)
    fabric.launch()
    model = c.make_model(seed)
    optimizer = c.make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    return fabric, model, optimizer, scheduler


def steps(fabric: Fabric, model, optimizer, n: int, start: int) -> list[float]:
    x, y = c.make_data(BEFORE + AFTER, fabric.world_size)
    losses = []
    for s in range(start, start + n):
        optimizer.zero_grad()
        loss = c.loss_fn(model(c.local(x[s], fabric.global_rank)), c.local(y[s], fabric.global_rank))
        fabric.backward(loss, model=model)
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return losses


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def save_phase(out: Path) -> dict:
    result: dict = {}
    for name, stage, precision in CONFIGS:
        c.mark(f"save {name}")
        fabric, model, optimizer, scheduler = build(stage, precision, seed=0)
        steps(fabric, model, optimizer, BEFORE, 0)
        counter = Counter(7)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": BEFORE, "counter": counter}
        fabric.save(out / f"ck_{name}", state)
        live = c.full_params(fabric, model)
        if fabric.global_rank == 0:
            torch.save(live, out / f"live_{name}.pt")
        result[name] = {"after": steps(fabric, model, optimizer, AFTER, BEFORE), "lr": scheduler.get_last_lr()}
        if name == "s2":
            result["files"] = listing(out / "ck_s2") if fabric.global_rank == 0 else None
            result["errors"], result["faults"] = bad_inputs(fabric, model, optimizer, scheduler, out)
        if stage in (2, 3) and precision == "32-true":
            result[f"load_raw_{name}"] = load_raw_check(fabric, stage, out)
    return result


def bad_inputs(fabric: Fabric, model, optimizer, scheduler, out: Path) -> tuple[dict, dict]:
    errors: dict[str, str] = {}
    state = {"model": model, "optimizer": optimizer, "step": 1}
    target = out / "ck_s2"
    errors["filter"] = c.expect_error(
        TypeError, "filter=...)` is not supported", fabric.save, target, state, filter={"model": lambda k, v: True}
    )
    errors["storage_options"] = c.expect_error(
        TypeError, "storage_options=...)` is not supported", fabric.strategy.save_checkpoint, target, state, storage_options={}
    )
    errors["async"] = c.expect_error(NotImplementedError, "async_save=True", fabric.save, target, state, async_save=True)
    other = c.make_model(4)
    other, other_opt = fabric.setup(other, c.make_optimizer(other))
    errors["two_models"] = c.expect_error(
        ValueError, "Found multiple DeepSpeed engine modules", fabric.save, out / "two", {"a": model, "b": other}
    )
    errors["no_model"] = c.expect_error(ValueError, "Could not find a DeepSpeed model", fabric.save, out / "none", {"step": 1})
    # A state that cannot be pickled fails on every rank before DeepSpeed's collectives; the old checkpoint stays.
    before = {p: p.stat().st_mtime_ns for p in target.rglob("*") if p.is_file()} if fabric.global_rank == 0 else {}
    errors["unpicklable"] = c.expect_error(
        Exception, "", fabric.save, target, {"model": model, "fn": lambda: None}
    )
    faults: dict = {}
    if fabric.global_rank == 0:
        after = {p: p.stat().st_mtime_ns for p in target.rglob("*") if p.is_file()}
        faults["files_unchanged"] = before == after
        faults["leftovers"] = [p.name for p in out.iterdir() if is_temporary(p)]
    # Saving onto a folder of the user's is refused instead of replacing it.
    user_dir = out / "user_dir"
    if fabric.global_rank == 0:
        user_dir.mkdir(exist_ok=True)
        (user_dir / "notes.txt").write_text("mine")
    fabric.barrier()
    errors["user_dir"] = c.expect_error(FileExistsError, "not a DeepSpeed checkpoint", fabric.save, user_dir, state)
    # Overwriting a checkpoint replaces it as a whole.
    fabric.save(out / "twice", state)
    fabric.save(out / "twice", {**state, "step": 2})
    if fabric.global_rank == 0:
        faults["twice"] = listing(out / "twice")
        faults["leftovers_after_twice"] = [p.name for p in out.iterdir() if is_temporary(p)]
    # Loading: bad paths and states say what is wrong.
    errors["load_missing"] = c.expect_error(FileNotFoundError, "nothing exists there", fabric.load, out / "missing", state)
    errors["load_tag_folder"] = c.expect_error(
        FileNotFoundError, "load the directory that holds it", fabric.load, target / "checkpoint", state
    )
    errors["load_empty_state"] = c.expect_error(ValueError, "a state with at least", fabric.load, target, {})
    errors["load_unknown_key"] = c.expect_error(KeyError, "'nope'", fabric.load, target, {"model": model, "nope": 1})
    errors["load_raw_optimizer"] = c.expect_error(
        NotImplementedError, "ZeRO optimizer is not supported", fabric.load_raw, out / "raw.pt", optimizer
    )
    return errors, faults


def load_raw_check(fabric: Fabric, stage: int, out: Path) -> dict:
    """A plain state dict loads into a DeepSpeed model (and its master weights): training continues from it exactly
    as an engine built from those weights."""
    raw = out / "raw.pt"
    if fabric.global_rank == 0:
        torch.save(c.make_model(7).state_dict(), raw)
    fabric.barrier()
    loaded = c.make_model(3)
    loaded, loaded_opt = fabric.setup(loaded, c.make_optimizer(loaded))
    fabric.load_raw(raw, loaded)
    direct = c.make_model(7)
    direct, direct_opt = fabric.setup(direct, c.make_optimizer(direct))
    return {
        "loaded": steps(fabric, loaded, loaded_opt, 3, 0),
        "direct": steps(fabric, direct, direct_opt, 3, 0),
        "weights_diff": c.max_diff(c.full_params(fabric, loaded), c.full_params(fabric, direct)),
    }


def resume_phase(out: Path) -> dict:
    result: dict = {}
    for name, stage, precision in CONFIGS:
        c.mark(f"resume {name}")
        fabric, model, optimizer, scheduler = build(stage, precision, seed=99)
        counter = Counter(0)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "counter": counter}
        remainder = fabric.load(out / f"ck_{name}", state)
        result[name] = {
            "remainder": sorted(remainder),
            "step": state["step"],
            "counter": counter.n,
            "lr": scheduler.get_last_lr(),
            "after": steps(fabric, model, optimizer, AFTER, BEFORE),
        }
    # Only the model: the rest comes back as the remainder.
    fabric, model, optimizer, scheduler = build(2, "32-true", seed=98)
    remainder = fabric.load(out / "ck_s2", {"model": model})
    live = torch.load(out / "live_s2.pt", weights_only=True)
    result["model_only"] = {"remainder": sorted(remainder), "diff": c.max_diff(c.full_params(fabric, model), live)}
    return result


def main() -> None:
    out, phase = c.out_dir(), sys.argv[2]
    result = save_phase(out) if phase == "save" else resume_phase(out)
    if int(os.environ["RANK"]) == 0:
        c.dump(out / f"checkpoint_{phase}.json", result)
    if phase == "save":
        resize_checks.run_phase(out, "save")  # the checkpoints that resize_checks.py grow loads on 3 ranks


if __name__ == "__main__":
    main()
