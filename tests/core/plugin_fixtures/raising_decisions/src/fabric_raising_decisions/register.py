"""Every decision hook raises (asked first, tryfirst): each must be skipped and reported, not break Fabric()."""

from fabric_core.plugins import hookimpl


def _boom(hook):
    raise RuntimeError(f"{hook} exploded on purpose")


@hookimpl(tryfirst=True)
def fabric_auto_accelerator(registry):
    _boom("fabric_auto_accelerator")


@hookimpl(tryfirst=True)
def fabric_auto_strategy(registry, accelerator, num_devices, num_nodes, interactive):
    _boom("fabric_auto_strategy")


@hookimpl(tryfirst=True)
def fabric_adjust_strategy(registry, strategy, accelerator, num_devices, num_nodes):
    _boom("fabric_adjust_strategy")


@hookimpl(tryfirst=True)
def fabric_select_precision(registry, precision, strategy, accelerator):
    _boom("fabric_select_precision")


@hookimpl(tryfirst=True)
def fabric_detect_cluster_environment(registry):
    _boom("fabric_detect_cluster_environment")


@hookimpl(tryfirst=True)
def fabric_select_launcher(registry, strategy):
    _boom("fabric_select_launcher")
