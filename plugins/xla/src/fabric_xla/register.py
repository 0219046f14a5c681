"""fabric-xla's hook implementations: names (as import strings), and the XLA family's decisions.

Importing this module is cheap and never imports torch_xla (every ``Fabric()`` imports it): availability comes from
:mod:`fabric_xla.detect` (files and environment variables). The XLA strategies choose their precision themselves
(``precision_for``), so no hook here needs to recognise them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.accelerators import Accelerator
    from fabric_core.plugins import Registrar, Registry
    from fabric_core.strategies import Strategy

DISTRIBUTION = "fabric-xla"
_STRATEGIES = "fabric_xla.strategy:"
#: The reference's words for a strategy that cannot run on XLA devices.
XLA_STRATEGIES_ONLY = (
    "The `XLAAccelerator` can only be used with a `SingleDeviceXLAStrategy`, `XLAStrategy`, or `XLAFSDPStrategy`."
)


@hookimpl
def fabric_register_accelerators(registrar: Registrar) -> None:
    registrar.add(
        "tpu",
        "fabric_xla.accelerator:XLAAccelerator",
        description="XLA devices through torch_xla: TPUs, or the PJRT device in PJRT_DEVICE (CPU for tests)",
        aliases={"xla": None},
    )


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add("single_xla", _STRATEGIES + "SingleDeviceXLAStrategy", description="one process on one XLA device")
    registrar.add(
        "xla",
        _STRATEGIES + "XLAStrategy",
        description="data parallel over XLA replicas, one per device; runs `launch(fn)` through torch_xla.launch",
    )
    registrar.add(
        "xla_fsdp",
        _STRATEGIES + "XLAFSDPStrategy",
        description="fully sharded data parallel under SPMD (torch_xla FSDPv2), one process for all devices",
    )


@hookimpl
def fabric_register_launchers(registrar: Registrar) -> None:
    registrar.add("xla", "fabric_xla.launcher:XLALauncher", description="torch_xla.launch: one replica per XLA device")


@hookimpl
def fabric_register_environments(registrar: Registrar) -> None:
    registrar.add(
        "xla",
        "fabric_xla.environment:XLAEnvironment",
        description="ranks from the torch_xla runtime (explicit only)",
        detected_by=(),  # never detected: the XLA strategies create it themselves, so detection need not import it
    )


@hookimpl(tryfirst=True)
def fabric_auto_accelerator(registry: Registry) -> str | None:
    """``"tpu"`` when a TPU is present (never for another PJRT device: ``accelerator="tpu"`` asks for those)."""
    from fabric_xla import detect

    return "tpu" if detect.tpu_present() else None


@hookimpl(tryfirst=True)
def fabric_auto_strategy(
    registry: Registry, accelerator: Accelerator, num_devices: int, num_nodes: int, interactive: bool
) -> str | None:
    """On XLA devices: ``xla`` for several devices or nodes, ``single_xla`` for one (the reference's choice)."""
    if accelerator.device_type != "xla":
        return None
    return "xla" if num_devices > 1 or num_nodes > 1 else "single_xla"


def _is_xla_strategy(registry: Registry, name: str) -> bool | None:
    entry = registry.lookup("strategy", name)
    return None if entry is None else entry.distribution == DISTRIBUTION


@hookimpl(tryfirst=True)
def fabric_adjust_strategy(
    registry: Registry, strategy: str, accelerator: Accelerator, num_devices: int, num_nodes: int
) -> str | None:
    """``fsdp`` on XLA devices becomes ``xla_fsdp``; other non-XLA strategies cannot run there (``ValueError``)."""
    if accelerator.device_type != "xla":
        return None
    if strategy == "fsdp":
        return "xla_fsdp"
    if _is_xla_strategy(registry, strategy) is False:
        raise ValueError(f"{XLA_STRATEGIES_ONLY} Got `strategy={strategy!r}`: use 'auto', 'single_xla', 'xla' or 'xla_fsdp'.")
    return None


@hookimpl(tryfirst=True)
def fabric_select_precision(registry: Registry, precision: str, strategy: Strategy, accelerator: Accelerator) -> Any:
    """A strategy of another family on XLA devices is refused. (The XLA strategies answer with their own
    ``XLAPrecision`` before this hook is asked: ``precision_for``.)"""
    if accelerator.device_type == "xla":
        raise ValueError(f"{XLA_STRATEGIES_ONLY} Got a `{type(strategy).__name__}`.")
    return None


@hookimpl
def fabric_report_packages() -> list[str]:
    """What ``fabric env`` reports for this plugin, installed or not."""
    return ["torch-xla"]


@hookimpl
def fabric_library_packages() -> dict[str, str]:
    """Frames the hang report reads as library code, not the user's line."""
    return {"fabric_xla": "library", "torch_xla": "library"}
