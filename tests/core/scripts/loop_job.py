"""``fabric.accumulate``, ``EMA`` and ``fabric.profile`` on 2 real processes (gloo) with a given strategy (ddp, fsdp,
deepspeed_stage_2).

Checks, written to ``<out>/rank<r>.json``: after a window of accumulated micro-batches the gradients equal those of
one step on all micro-batches of all ranks together (a model in this process computes that); under DDP the
gradients were not synchronised before the window's last micro-batch; the EMA equals averages computed by hand from
the whole parameters; evaluating with the averages and restoring is exact; the EMA round-trips through
``fabric.save``/``fabric.load`` exactly. Args: out strategy."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.loop.ema import EMA
from fabric_core.utilities.dtensor import to_full_tensor

STEPS, MICRO = 4, 2  # micro-batches per window, samples per micro-batch and rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def full(model: nn.Module) -> dict:
    return {n: to_full_tensor(p.detach()).clone() for n, p in model.module.named_parameters()}


def main(out: Path, strategy: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    reference = make_model()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(1)
    x, y = torch.randn(STEPS * world * MICRO, 4), torch.randn(STEPS * world * MICRO, 1)
    seen: dict = {"synced": [], "unsynced_differs": []}

    # --- accumulation: one window of STEPS micro-batches
    for k in range(STEPS):
        start = (k * world + rank) * MICRO
        with fabric.accumulate(model, STEPS) as last:
            loss = nn.functional.mse_loss(model(x[start : start + MICRO]), y[start : start + MICRO])
            fabric.backward(loss / STEPS)
        seen["synced"].append(last)
        if strategy == "ddp" and not last:
            grad = next(model.parameters()).grad.clone()
            gathered = fabric.all_gather(grad)
            seen["unsynced_differs"].append(not torch.equal(gathered[0], gathered[1]))
    nn.functional.mse_loss(reference(x), y).backward()
    if not strategy.startswith("deepspeed"):  # a ZeRO engine keeps gradients in its own partitioned buffers
        grads = {n: to_full_tensor(p.grad) for n, p in model.module.named_parameters()}
        seen["grads_match"] = all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in reference.named_parameters())
    optimizer.step()
    optimizer.zero_grad()
    stepped = {n: p.detach() - 0.1 * p.grad for n, p in reference.named_parameters()}  # SGD on the large batch
    seen["step_matches"] = all(torch.allclose(v, stepped[n], atol=1e-6) for n, v in full(model).items())

    # --- EMA: averages by hand from the whole parameters
    ema = EMA(model, decay=0.5)
    expected = full(model)
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        expected = {n: 0.5 * v + 0.5 * full(model)[n] for n, v in expected.items()}
    averages = ema.state_dict()["averages"]
    seen["ema_matches"] = all(torch.allclose(averages[n], expected[n], atol=1e-6) for n in expected)
    trained = full(model)
    with ema.average_parameters():
        seen["evaluates_with_averages"] = all(torch.equal(v, averages[n]) for n, v in full(model).items())
    seen["restored_exactly"] = all(torch.equal(v, trained[n]) for n, v in full(model).items())

    # --- exact round trip through fabric.save / fabric.load
    path = out / "ckpt"
    fabric.save(path, {"model": model, "ema": ema})
    other = make_model()
    other, _ = fabric.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
    other_ema = EMA(other, decay=0.9)
    fabric.load(path, {"model": other, "ema": other_ema})
    loaded = other_ema.state_dict()
    seen["ema_round_trip"] = all(torch.equal(loaded["averages"][n], averages[n]) for n in averages)
    seen["ema_counters"] = [loaded["num_updates"], loaded["decay"]]
    seen["ema_layout_kept"] = [type(t).__name__ for t in other_ema.averages.values()] == [type(t).__name__ for t in ema.averages.values()]
    # --- profiling a step on every rank: traces per rank, the summary from rank 0
    with fabric.profile(out / "profile"):
        fabric.backward(model(x[rank::world]).sum(), model=model)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
