"""Plugin objects the plugin-host tests register: small subclasses of the core's base classes that record what
happened to them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.environments.plain import PlainEnvironment
from fabric_core.launchers.base import Launcher
from fabric_core.precision.base import Precision
from fabric_core.strategies.base import Binding
from fabric_core.strategies.single_device import SingleDeviceStrategy


def last_json_line(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


class CountingCPUAccelerator(CPUAccelerator):
    name = "counting_cpu"


class RecordingStrategy(SingleDeviceStrategy):
    """Keeps the cluster environment it is attached with (the single-device strategy does not need one), and
    accepts any number of devices (it computes on the first), so it can stand in for a multi-device answer."""

    def attach(self, binding: Binding) -> None:
        super().attach(dataclasses.replace(binding, devices=list(binding.devices)[:1]))
        self.cluster_environment = binding.cluster_environment


class RecordingLauncher(Launcher):
    is_interactive_compatible = True

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.launched: list[Any] = []

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        self.launched.append(function)
        return function(*args, **kwargs)


class NeedsLauncherStrategy(SingleDeviceStrategy):
    launcher_name = "recording"


class MarkerPrecision(Precision):
    precision = "32-true"


class AlwaysHereEnvironment(PlainEnvironment):
    name = "always_here"
    detect_priority = -1  # before torchelastic, SLURM, ... and the plain fallback

    @classmethod
    def detect(cls) -> bool:
        return True
