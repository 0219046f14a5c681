"""Implementation module of ``strategy="example_single"``; imported only when that name is resolved."""

from __future__ import annotations

from typing import Any

from fabric_core.strategies import SingleDeviceStrategy


class StepCountingStrategy(SingleDeviceStrategy):
    """The core's single-device strategy, plus a count of optimizer steps taken through Fabric.

    The count makes the plugin observable: after ``optimizer.step()`` on a Fabric-wrapped optimizer,
    ``fabric.strategy.optimizer_steps`` has gone up by one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_steps = 0

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.optimizer_steps += 1
        return output
