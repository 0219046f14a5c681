"""Every hook a Fabric plugin can implement, in one place.

A plugin is a module (or object) with functions decorated by :data:`hookimpl` whose names match the
specifications below. The core's own built-ins are plugins too (:mod:`fabric_core.plugins.builtin`) and go through
exactly the same hooks; third parties register theirs through the ``fabric.plugins`` entry-point group. A
function named ``fabric_*`` that matches no specification is an error, reported when the plugin is loaded.

Two kinds of hooks exist:

* **Registration hooks** (``fabric_register_*``, one per kind of :data:`fabric_core.plugins.kinds.KINDS`) are
  called once per plugin, in the load order, when the registry is built. They receive a :class:`~fabric_core.plugins.registry.Registrar` bound to one kind (accelerator,
  strategy, ...) and add *names*. A name points at a class either directly or as an import string
  ``"package.module:Class"``, so listing names never imports the heavy module behind them.
* **Decision hooks** (``firstresult``) replace what would otherwise be a hard-coded ``isinstance`` chain
  in the core: the first implementation that returns something other than ``None`` wins. They are asked in a
  fixed order (:mod:`fabric_core.plugins.decisions`): ``tryfirst=True`` implementations, then plain ones, then
  ``trylast=True`` ones (the core's defaults); within each group earlier in the load order first (the core,
  first-party distributions, then the others alphabetically). An implementation that raises is reported and
  skipped unless the decision concerns an object its own plugin provides.

Importing this module costs nothing: heavy types are only imported for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.launchers.base import Launcher
    from fabric_core.plugins.registry import Registrar, Registry
    from fabric_core.precision.base import Precision
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


@hookspec
def fabric_register_loggers(registrar: Registrar) -> None:
    """Add experiment logger names (``Fabric(loggers=NAME)``, ``loggers=[NAME, ...]``, ``loggers={NAME: options}``).

    ``target`` is a logger class (a :class:`~fabric_core.loggers.Logger` subclass, or any class with that interface)
    or an import string; it is constructed as ``target(**init_kwargs, **options)`` with the user's options for that
    name (theirs win). Register defaults that make the bare name useful (a log folder, a project name). The target's
    module is imported only when the name is used, so it may import its tracking framework at the top: a broken
    installation then fails that name only, as a :class:`~fabric_core.plugins.registry.PluginImportError` naming
    the distribution.
    """


@hookspec
def fabric_register_checkpoint_formats(registrar: Registrar) -> None:
    """Add checkpoint format names: layouts any strategy can load, and write when asked to.

    ``target`` is a :class:`~fabric_core.io.format.CheckpointFormat` subclass (or import string) constructed as
    ``target(**init_kwargs)``. Pass ``recognised_by="pkg.layout:is_mine"``, a cheap function ``location -> bool``
    that imports nothing heavy, so asking which format a checkpoint is in imports your format's module only when it
    is yours. A checkpoint that the loading strategy's own formats do not recognise is read whole by the first
    registered format that does (in the load order) and restored through that strategy's adapters; ``fabric
    consolidate`` reads folders the same way. ``Strategy.save_checkpoint(..., checkpoint_format=...)`` writes
    with any format (``registry.create("checkpoint_format", name)``). The core registers ``single_file``.
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

    Asked after the strategy itself had its say and before it is bound (``strategy`` is as constructed; the
    resolved ``accelerator`` is passed), and a strategy that needs its own precision type (FSDP, DeepSpeed, XLA)
    returns it from
    :meth:`~fabric_core.strategies.base.Strategy.precision_for`, so this hook only sees strategies that leave the
    choice to others. ``precision`` is normalised (``"bf16-mixed"``, ``"32-true"``, ...) when a registered
    precision knows the name, otherwise it is the user's value lower-cased. Implement it for a rule across
    strategies (an accelerator plugin refusing strategies of other families on its devices); return ``None`` for
    what is not yours. The core's default (``trylast``) builds the registered precision of that name. Raise
    ``ValueError`` for a combination that cannot run.
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

    Asked last in the binding step (:meth:`~fabric_core.strategies.base.Strategy.bind`), so ``strategy`` is complete
    (devices, environment, precision). The core's default (``trylast``) builds the registered launcher named by
    ``strategy.launcher_name``, unless the cluster environment already created the processes (``fabric run``,
    torchrun, SLURM ...).
    """


@hookspec(firstresult=True)
def fabric_adjust_strategy(
    registry: Registry, strategy: str, accelerator: Accelerator, num_devices: int, num_nodes: int
) -> str | None:
    """Return another registered strategy name to use instead of the requested ``strategy``, or ``None``.

    Called once for every strategy requested by name (after ``strategy="auto"`` is answered), before the strategy
    is built, with the lower-cased name, the resolved accelerator and the number of devices per node and of
    nodes. The plugin that owns a family answers the rules of that family, for example "``dp`` on the CPU
    becomes ``ddp``" (fabric-ddp) or "``fsdp`` on a TPU becomes ``xla_fsdp``" (fabric-xla); warn the user
    yourself when the change deserves it. The answer is not asked again. The core has no default.
    """


@hookspec
def fabric_report_packages() -> list[str]:
    """Return the distribution names whose versions ``fabric env`` reports for this plugin: the frameworks it drives.

    They are listed installed or not ("not installed" answers the first question about a problem with them), read
    from package metadata only, never imported. fabric-deepspeed answers ``["deepspeed"]``, fabric-xla
    ``["torch-xla"]``. Every plugin's answer is collected.
    """


@hookspec
def fabric_report_services() -> dict[str, str]:
    """Return ``{label: state}`` lines ``fabric env`` shows about the services this plugin connects to, such as
    whether a cluster is reachable (``{"Ray cluster": "reachable at 10.0.0.1:6379"}``).

    A bug report's first question is often "could this machine reach it at all?", which package versions do not
    answer. Asked only by ``fabric env``: answer within a couple of seconds (short timeouts, no framework imports
    that start a runtime); an exception shows as the plugin's error line and ends nothing else. Every plugin's
    answer is collected.
    """


@hookspec
def fabric_library_packages() -> dict[str, str]:
    """Return the import packages whose frames the hang report reads as library code, each mapped to ``"library"``
    or ``"collective"``: your own package and the frameworks you drive.

    A rank that makes no progress for ``FABRIC_HANG_TIMEOUT`` seconds is reported with the line of the *user's* code
    it is at, so frames of these packages are skipped when naming it; a rank whose innermost frame is in a
    ``"collective"`` (sub)package (``"deepspeed.comm"``) is waiting for the other ranks, and is reported as such.
    Asked only when hang detection starts. fabric-deepspeed answers ``{"fabric_deepspeed": "library", "deepspeed":
    "library", "deepspeed.comm": "collective"}``. The core, torch and the standard library need no answer; packages
    installed in ``site-packages`` are library code anyway. Every plugin's answer is collected.
    """


#: Every hook name declared above.
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, obj in list(globals().items()) if hasattr(obj, f"{PROJECT_NAME}_spec")
)
