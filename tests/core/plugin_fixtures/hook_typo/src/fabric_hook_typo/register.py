"""A misspelled hook (`fabric_register_strategy`): the plugin must be rejected at discovery, named."""

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_strategy(registrar):
    registrar.add("typo_strategy", "fabric_core.strategies.single_device:SingleDeviceStrategy")


@hookimpl
def fabric_register_accelerators(registrar):
    registrar.add("typo_cpu", "fabric_core.accelerators.cpu:CPUAccelerator")
