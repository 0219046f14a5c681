"""A LightningModule (from the real ``lightning`` package) trained by our Fabric, as a user moving from the Trainer
keeps it: ``self.log`` inside the module, hooks called through ``fabric.call``, ``self.optimizers()`` and
``self.manual_backward``. Writes what it saw to ``<out>/rank<r>.json``. Args: out strategy devices method."""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule

from fabric_core import Fabric
from fabric_core.loggers import CSVLogger


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.hooks: list[str] = []

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("train_loss", loss)
        self.log_dict({"twice": loss * 2})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_epoch_end(self) -> None:
        self.hooks.append(f"on_train_epoch_end:{self.fabric.global_rank}")

    def on_after_setup(self, fabric, module) -> None:  # our Fabric's own hook reaches the module too
        self.hooks.append("on_after_setup")


def main(out: Path, strategy: str, devices: int, method: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=devices, loggers=CSVLogger(root_dir=out, name="csv"))
    fabric.launch()
    model = Model()
    if method == "setup":
        model_, optimizer = fabric.setup(model, model.configure_optimizers())
    else:
        model_ = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(model.configure_optimizers())
    for _ in range(3):
        loss = model_.training_step(torch.randn(8, 4, device=fabric.device))
        model.manual_backward(loss)  # through fabric.backward
        optimizer.step()
        optimizer.zero_grad()
    fabric.call("on_train_epoch_end")
    fabric.logger.save()
    seen = {
        "fabric_is_ours": model.fabric is fabric,
        "trainer_rank": model.trainer.global_rank,  # the reference's shim: attribute access goes to the Fabric
        "optimizers_is_wrapped": model.optimizers() is optimizer if method == "setup" else model._fabric_optimizers == [],
        "in_callbacks": sum(c is model for c in fabric._callbacks),
        "hooks": model.hooks,
        "log_dir": fabric.logger.log_dir,
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
