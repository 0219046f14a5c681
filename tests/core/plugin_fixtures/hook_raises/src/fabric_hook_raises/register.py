"""A plugin whose strategy registration hook raises; its accelerator hook works."""

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_accelerators(registrar):
    registrar.add("hook_raises_cpu", "fabric_core.accelerators.cpu:CPUAccelerator", description="still works")


@hookimpl
def fabric_register_strategies(registrar):
    raise RuntimeError("registration exploded on purpose")
