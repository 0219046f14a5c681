"""The seed articles' calls on 2 CPU processes, as a user runs them after a bare ``pip install``.

``python seeds_calls.py STRATEGY OUT_DIR``: setup, a few training steps with ``backward``, ``broadcast`` of objects,
``all_gather``/``all_reduce``, ``save`` and ``load`` into fresh objects (training then continues identically), and
``load_raw`` of a plain state dict. The bare-install lane (``tests/bare_install/lane.py``) runs it in a venv that
holds only torch, our wheels and what they declare, so it imports nothing else: no pytest, no test helpers.
Each rank checks its own results and prints ``seeds-calls ok`` at the end; any failed check raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric

STEPS_PER_EPOCH = 4


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def full(value: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor (a sharded DTensor is gathered)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(value).detach().clone().float() for name, value in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> float:
    loss = torch.tensor(0.0)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss, model=model)  # DeepSpeed asks which model once there are several
        optimizer.step()
    return float(fabric.all_reduce(loss.detach()))


def main() -> None:
    strategy, out = sys.argv[1], Path(sys.argv[2])
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    fabric.seed_everything(42)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=64 // (2 * STEPS_PER_EPOCH), shuffle=False))
    model = make_model(1)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = [train(fabric, model, optimizer, loader) for _ in range(4)]
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"

    # collectives on objects and tensors
    assert fabric.broadcast({"step": 3, "from": rank}) == {"step": 3, "from": 0}
    assert fabric.broadcast(f"rank {rank} " * 1000, src=1) == "rank 1 " * 1000
    gathered = fabric.all_gather(torch.tensor([rank, 10 + rank]))
    assert gathered.tolist() == [[0, 10], [1, 11]], gathered
    collection = fabric.all_gather({"rank": rank, "twice": torch.tensor(2.0 * rank)})
    assert collection["rank"].tolist() == [0, 1] and collection["twice"].tolist() == [0.0, 2.0], collection
    assert float(fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum")) == 1.0

    # save, then load into fresh objects: the weights match and training continues identically
    checkpoint = out / f"{strategy}.ckpt"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": 16})
    saved = weights(model)
    restored = make_model(2)
    restored, restored_optimizer = fabric.setup(restored, torch.optim.AdamW(restored.parameters(), lr=1e-2))
    assert not same(weights(restored), saved)
    state = {"model": restored, "optimizer": restored_optimizer, "step": 0}
    fabric.load(checkpoint, state)
    assert state["step"] == 16, state["step"]
    assert same(weights(restored), saved), "the loaded weights differ from the saved ones"
    fabric.seed_everything(7)
    continued = train(fabric, model, optimizer, loader)
    fabric.seed_everything(7)
    assert train(fabric, restored, restored_optimizer, loader) == continued, "training after load differs"

    # load_raw: a plain PyTorch state dict written by rank 0
    raw = out / f"{strategy}-raw.pt"
    plain = make_model(3)
    if fabric.is_global_zero:
        torch.save(plain.state_dict(), raw)
    fabric.barrier()
    target = make_model(4)
    target, _ = fabric.setup(target, torch.optim.AdamW(target.parameters(), lr=1e-2))
    fabric.load_raw(raw, target)
    assert same(weights(target), weights(plain)), "load_raw did not load the plain state dict"

    # One write (print() writes the text and its newline separately), so the other rank's line cannot split it.
    sys.stdout.write(f"[rank {rank}] seeds-calls ok ({strategy}, numpy importable: {_has_numpy()})\n")
    sys.stdout.flush()


def _has_numpy() -> bool:
    import importlib.util

    return importlib.util.find_spec("numpy") is not None


if __name__ == "__main__":
    main()
