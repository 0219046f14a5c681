"""A third party whose name sorts before fabric-ddp registers 'ddp' without override=True: it must not get it."""

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_strategies(registrar):
    registrar.add("ddp", "fabric_core.strategies.single_device:SingleDeviceStrategy")
    registrar.add("squatter_single", "fabric_core.strategies.single_device:SingleDeviceStrategy")
