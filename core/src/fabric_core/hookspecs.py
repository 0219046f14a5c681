"""Every hook a Fabric plugin can implement, in one place.

A plugin is a module (or object) with functions decorated by :data:`hookimpl` whose names match the
specifications below. The core's own built-ins are plugins too (:mod:`fabric_core.builtin`) and go through
exactly the same hooks; third parties register theirs through the ``fabric.plugins`` entry-point group.

Two kinds of hooks exist:

* **Registration hooks** (``fabric_register_*``) are called once, when the plugin manager is first used.
  They receive a :class:`~fabric_core.registry.Registrar` bound to one kind (accelerator, strategy, ...)
  and add *names*. A name points at a class either directly or as an import string
  ``"package.module:Class"``, so listing names never imports the heavy module behind them.
* **Decision hooks** (``firstresult``) replace what would otherwise be a hard-coded ``isinstance`` chain
  in the core: the first implementation that returns something other than ``None`` wins. Plugins that
  want to answer before the core's defaults mark their implementation ``tryfirst=True``; the core's
  defaults are ``trylast=True``.

Importing this module costs nothing: heavy types are only imported for type checking.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.launchers.base import Launcher
    from fabric_core.precision.base import Precision
    from fabric_core.registry import Registrar, Registry
    from fabric_core.strategies.base import Strategy

PROJECT_NAME = "fabric"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------------------------------------------
# Registration hooks
# --------------------------------------------------------------------------------------------------------------


@hookspec
def fabric_register_accelerators(registrar: Registrar) -> None:
    """Add accelerator names (``Fabric(accelerator=NAME)``).

    Call ``registrar.add(name, target, description=..., aliases=..., **init_kwargs)`` once per name.
    ``target`` is an :class:`~fabric_core.accelerators.base.Accelerator` subclass or an import string
    ``"pkg.module:Class"``. Return value is ignored.
    """


@hookspec
def fabric_register_strategies(registrar: Registrar) -> None:
    """Add strategy names (``Fabric(strategy=NAME)``).

    Same contract as :func:`fabric_register_accelerators`; ``target`` is a
    :class:`~fabric_core.strategies.base.Strategy` subclass (or import string). ``init_kwargs`` are passed to
    its constructor, so one class can back several names (``ddp_spawn`` = DDP with ``start_method="spawn"``).
    """


@hookspec
def fabric_register_precisions(registrar: Registrar) -> None:
    """Add precision names (``Fabric(precision=NAME)``).

    ``target`` is a :class:`~fabric_core.precision.base.Precision` subclass (or import string); it is
    constructed as ``target(**init_kwargs)``. ``aliases`` may map a legacy spelling to a warning message that
    is emitted when the alias is used (``{"16": "precision=16 is discouraged..."}``), or to ``None`` for a
    silent alias (``{"32": None}``).
    """


@hookspec
def fabric_register_launchers(registrar: Registrar) -> None:
    """Add launcher names. A strategy names the launcher it needs in its ``launcher_name`` attribute.

    ``target`` is a :class:`~fabric_core.launchers.base.Launcher` subclass constructed as
    ``target(strategy, **init_kwargs)``.
    """


@hookspec
def fabric_register_environments(registrar: Registrar) -> None:
    """Add cluster environments (SLURM, torchelastic, ...).

    ``target`` is a :class:`~fabric_core.environments.base.ClusterEnvironment` subclass (or import string).
    Its ``detect()`` classmethod and ``detect_priority`` decide automatic detection (see
    :func:`fabric_detect_cluster_environment`).
    """


# --------------------------------------------------------------------------------------------------------------
# Decision hooks (first non-None answer wins)
# --------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def fabric_auto_accelerator(registry: Registry) -> str | None:
    """Return the accelerator *name* that ``accelerator="auto"`` should use on this machine, or ``None``.

    Called only when the user asked for ``"auto"``. Implementations must be cheap and must not initialise a
    device runtime they do not own. The core's default (``trylast``) answers ``"cuda"``, then ``"mps"``, then
    ``"cpu"``, by availability. An XLA plugin answers ``"tpu"`` first when XLA devices exist.
    """


@hookspec(firstresult=True)
def fabric_auto_strategy(
    registry: Registry, accelerator: Accelerator, num_devices: int, num_nodes: int, interactive: bool
) -> str | Strategy | None:
    """Return the strategy (a registered name or an instance) for ``strategy="auto"``, or ``None``.

    ``num_devices`` is the number of devices per node after parsing ``devices``; ``interactive`` is True in a
    notebook or ``python -i``. The core answers only for a single device on a single node (its
    single-device strategy); multi-device answers come from parallel plugins such as ``fabric-ddp``. When no
    plugin answers, resolution fails with a hint naming the distribution to install.
    """


@hookspec(firstresult=True)
def fabric_select_precision(
    registry: Registry, precision: str, strategy: Strategy, accelerator: Accelerator
) -> Precision | None:
    """Return the precision object that ``strategy`` needs for the canonical precision name ``precision``.

    ``precision`` is normalised (``"bf16-mixed"``, ``"32-true"``, ...) when a registered precision knows the
    name, otherwise it is the user's value lower-cased, so a strategy plugin can serve precision names that no
    precision plugin registers (return ``None`` for names you do not serve). Strategy plugins that need
    their own precision type (FSDP, DeepSpeed, XLA) implement this with ``tryfirst=True`` and return ``None``
    for strategies that are not theirs. The core's default (``trylast``) builds the registered precision
    of that name. Raise ``ValueError`` for a combination the strategy cannot run.
    """


@hookspec(firstresult=True)
def fabric_detect_cluster_environment(registry: Registry) -> ClusterEnvironment | None:
    """Return the cluster environment this process runs in, or ``None`` to let others decide.

    The core's default (``trylast``) instantiates the first registered environment whose ``detect()`` is
    true, in ascending ``detect_priority`` (torchelastic, SLURM, LSF, MPI, ..., plain env vars last).
    """


@hookspec(firstresult=True)
def fabric_select_launcher(registry: Registry, strategy: Strategy) -> Launcher | None:
    """Return the launcher that starts the processes for ``strategy``, or ``None`` for "no launcher".

    The core's default (``trylast``) builds the registered launcher named by ``strategy.launcher_name``,
    unless the cluster environment already created the processes (``fabric run``, torchrun, SLURM ...).
    """


@hookspec(firstresult=True)
def fabric_checkpoint_loader(path: Path) -> Any | None:
    """Return a callable ``load(path, map_location) -> dict`` that can read the checkpoint at ``path``.

    Used when a checkpoint was written in a format that belongs to a plugin (a sharded directory from FSDP,
    a DeepSpeed folder) and is now read by a strategy that does not know that format (e.g. a single-device
    run). Return ``None`` when the path is not in your format. The core itself reads single files.
    """
