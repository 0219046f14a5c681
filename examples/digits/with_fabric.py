"""Classify 8x8 handwritten digits with a small CNN: ``plain_pytorch.py`` converted to Fabric.

``diff -u plain_pytorch.py with_fabric.py`` shows the five conversion steps, each marked ``# Step N``:
create a ``Fabric``, launch the processes, set up model/optimizer and dataloaders, drop the ``.to(device)``
calls, and replace ``loss.backward()`` with ``fabric.backward(loss)``. Three optional changes make it a good
multi-process citizen: ``fabric.seed_everything``, test metrics summed over all processes with
``fabric.all_reduce``, and printing/saving through ``fabric.print``/``fabric.save``.

Run it::

    python examples/digits/with_fabric.py                              # one process
    python examples/digits/with_fabric.py --devices 2 --strategy ddp   # two DDP processes (fabric-ddp)
    fabric run --devices 2 examples/digits/with_fabric.py              # the CLI starts the processes

``fabric run`` starts the processes itself and marks them with ``FABRIC_CLI_USED=1``; then the script must
not call ``fabric.launch()`` (Fabric raises), which is why that call is guarded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """A fixed 80/20 train/test split of the bundled digits, scaled to [0, 1]."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(labels))
    train, test = order[:n_train], order[n_train:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def run(args: argparse.Namespace) -> None:
    # Step 1: create the Fabric object (instead of choosing a device by hand).
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    # Step 2: start the processes (only when `fabric run` has not started them already).
    if os.environ.get("FABRIC_CLI_USED") != "1":
        fabric.launch()

    fabric.seed_everything(args.seed)
    train_dataset, test_dataset = digits_datasets(args.seed)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_dataset, batch_size=args.batch_size)
    # Step 3: shard the data across processes and move batches to the device.
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net()  # Step 4: no .to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    # Step 3: set up the model and its optimizer (device placement, precision, DDP wrapping).
    model, optimizer = fabric.setup(model, optimizer)

    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            fabric.backward(loss)  # Step 5
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                fabric.print(f"epoch {epoch} batch {batch_idx} | train loss {loss.item():.4f}")
        scheduler.step()

        model.eval()
        test_loss, correct, seen = 0.0, 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += (output.argmax(dim=1) == target).sum().item()
                seen += len(target)
        # Optional: each process saw only its shard of the test set; add up the counts of all processes.
        totals = fabric.all_reduce(torch.tensor([test_loss, correct, seen]), reduce_op="sum")
        test_loss, correct, seen = totals.tolist()
        test_loss, accuracy = test_loss / seen, 100.0 * correct / seen
        fabric.print(
            f"epoch {epoch} | test loss {test_loss:.4f} | accuracy {accuracy:.2f}% ({correct:.0f}/{seen:.0f})"
        )

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.abspath(os.path.join(args.out_dir, "digits_cnn.pt"))
    fabric.save(path, {"model": model})  # rank 0 writes, the others wait
    fabric.print(
        f"final test loss {test_loss:.4f} | accuracy {accuracy:.2f}% | world_size {fabric.world_size} | checkpoint {path}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Digits CNN (Fabric)")
    # Fabric's own defaults, so that `fabric run` can choose them without a conflict.
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=lambda v: int(v) if v.isdigit() else v, default="auto")
    parser.add_argument("--precision", default=None, help="e.g. 32-true, 64-true, bf16-mixed (fabric-amp)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--out-dir", default="demo_output/digits_fabric")
    return parser.parse_args()


if __name__ == "__main__":
    run(parse_args())
