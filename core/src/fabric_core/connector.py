"""Turns ``Fabric(...)`` arguments into accelerator, strategy, precision, environment and launcher objects.

Every decision that depends on what is installed goes through a hook (see :mod:`fabric_core.plugins.hookspecs`), so
this module has no knowledge of any particular strategy family. Importing it does not import torch (the CLI
reads its constants); the base classes are imported when something is resolved.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from fabric_core.launchers.base import CLI_FLAG, CLI_SETTINGS
from fabric_core.plugins.host import get_registry

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.plugins.registry import Registry
    from fabric_core.precision.base import Precision
    from fabric_core.strategies.base import Strategy

_DEFAULTS = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": None}
_CLI_OPTION = {"num_nodes": "--num-nodes"}


def launched_by_cli() -> bool:
    return os.environ.get(CLI_FLAG) == "1"


def is_interactive() -> bool:
    return hasattr(sys, "ps1") or bool(getattr(sys.flags, "interactive", 0))


class Resolved(NamedTuple):
    accelerator: Accelerator
    strategy: Strategy
    precision: Precision
    devices: list[Any]
    num_nodes: int


def apply_cli_settings(args: dict[str, Any]) -> dict[str, Any]:
    """Under ``fabric run``, take the CLI's settings; a conflicting explicit argument is an error.

    Deviation from the well-known implementation: the ``FABRIC_*`` settings only apply when the CLI started
    the process (``FABRIC_CLI_USED=1``), so a stray variable in a shell never silently changes a run.
    """
    if not launched_by_cli():
        _warn_ungated_settings()
        return args
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.strategies.base import Strategy

    out = dict(args)
    for key, var in CLI_SETTINGS.items():
        if var not in os.environ:
            continue
        cli_value: Any = os.environ[var]
        if key == "num_nodes":
            from fabric_core.environments.torchrun_variables import node_count

            cli_value = node_count(cli_value, var)
        given = args[key]
        if given != _DEFAULTS[key] and not isinstance(given, (Strategy, Accelerator)) and str(given) != str(cli_value):
            option = _CLI_OPTION.get(key, f"--{key}")
            shown = os.environ[var]
            raise ValueError(
                f"Your code has `Fabric({key}={given!r}, ...)` but it conflicts with the value `{option}={shown}`"
                " set through the CLI.  Remove it either from the CLI or from the Fabric object."
            )
        if not isinstance(given, (Strategy, Accelerator)):
            out[key] = cli_value
    return out


def _warn_ungated_settings() -> None:
    """``FABRIC_*`` settings in a process ``fabric run`` did not start are ignored (the gate above): say so, since a
    launcher that forgot the gate would otherwise run every process as a job of its own without a word."""
    present = [f"{var}={os.environ[var]}" for var in CLI_SETTINGS.values() if var in os.environ]
    if not present:
        return
    from fabric_core.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(
        f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set, but `Fabric(...)` takes the `FABRIC_*`"
        f" settings only in a process that `fabric run` started ({CLI_FLAG}=1), so {'it is' if len(present) == 1 else 'they are'}"
        " ignored here. A launcher that starts processes for `fabric run` sets the gate with everything else"
        " (`ScriptRequest.process_environment`); otherwise pass the values to `Fabric(...)` or unset the variables.",
        stacklevel=4,
    )


def elastic_node_count(nodes: tuple[int, int], env: ClusterEnvironment | None, num_devices: int) -> int:
    """The nodes of this attempt of an elastic job (``fabric run --num-nodes MIN:MAX``): the launcher's world over
    its processes per node (``LOCAL_WORLD_SIZE``, as torchrun exports it; else ``devices``), checked against the range."""
    low, high = nodes
    if env is None:
        raise ValueError(
            f"`num_nodes={low}:{high}` (an elastic range) needs a launcher that says how many nodes joined this time,"
            " such as `fabric run --num-nodes MIN:MAX` (torchrun's elastic agent); none started this process."
        )
    from fabric_core.environments.base import env_int

    world = env.world_size()
    per_node = env_int("LOCAL_WORLD_SIZE", default=num_devices) or num_devices
    count = world // per_node
    if world % per_node or not low <= count <= high:
        raise ValueError(
            f"The launcher started {world} processes, {per_node} per node, but the job's nodes may only number"
            f" {low} to {high} (`--num-nodes {low}:{high}`): start {per_node} processes on each of {low} to {high} nodes."
        )
    return count


def apply_torchrun_variables(args: dict[str, Any]) -> dict[str, Any]:
    """Where no launcher started this process, a pod's ``PET_*`` variables (torchrun's arguments, which Kubeflow
    sets) stand for ``devices``/``num_nodes`` left at their defaults, so ``Fabric()`` forms the world torchrun would
    form there. Explicit values are checked against them by the environment
    (:meth:`~fabric_core.environments.plain.PlainEnvironment.validate_settings`)."""
    if launched_by_cli() or "TORCHELASTIC_RUN_ID" in os.environ:
        return args  # the launcher already read them
    from fabric_core.environments.torchrun_variables import job_shape

    shape = job_shape()
    out = dict(args)
    if shape.num_nodes is not None and type(args["num_nodes"]) is int and args["num_nodes"] == _DEFAULTS["num_nodes"]:
        out["num_nodes"] = shape.num_nodes
    if shape.processes_per_node is not None and isinstance(args["devices"], str) and args["devices"] == "auto":
        out["devices"] = shape.processes_per_node
    return out


def _split_plugins(plugins: Any) -> tuple[Precision | None, ClusterEnvironment | None, CheckpointIO | None]:
    if plugins is None:
        return None, None, None
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.precision.base import Precision

    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    found: dict[type, Any] = {}
    counts: dict[str, int] = {}  # kinds in the order they first appear, as the reference lists duplicates
    for item in items:
        for base in (Precision, ClusterEnvironment, CheckpointIO):
            if isinstance(item, base):
                counts[base.__name__] = counts.get(base.__name__, 0) + 1
                found[base] = item
                break
        else:
            raise TypeError(
                f"Found invalid type for plugin {item!r}. Expected one of: Precision, CheckpointIO,"
                " ClusterEnvironment (strategies and accelerators go to the `strategy=`/`accelerator=` arguments)."
            )
    duplicates = [name for name, count in counts.items() if count > 1]
    if duplicates:
        raise ValueError(
            f"Received multiple values for {', '.join(duplicates)} flags in `plugins`."
            " Expected one value for each type at most."
        )
    return found.get(Precision), found.get(ClusterEnvironment), found.get(CheckpointIO)


def _precision_name(registry: Registry, precision: Any) -> str:
    """The name ``fabric_select_precision`` is asked with: canonical when a registered precision knows the user's
    value (emitting its alias warning), otherwise the value lower-cased, so a strategy plugin can serve precision
    names that no precision plugin registers (a sharding strategy's own mixed precision)."""
    key = "32-true" if precision is None else str(precision).strip().lower()
    if ("precision", key) in registry:
        return registry.canonical_name("precision", key)
    return key


def _unknown_precision(registry: Registry, precision: Any, strategy: Strategy) -> ValueError:
    key = str(precision).strip().lower()
    allowed = registry.all_names("precision")
    dist = registry.distribution_for("precision", key)
    if dist is not None:
        return ValueError(
            f"Precision {precision!r} is not installed. {registry.install_hint(dist)}"
            f" Installed precision values: ({', '.join(allowed)})."
        )
    if ("precision", key) in registry:
        return ValueError(f"No installed plugin provides precision {precision!r} for {type(strategy).__name__}.")
    return ValueError(f"Precision {precision!r} is invalid. Allowed precision values: ({', '.join(allowed)}).")


def resolve_accelerator(registry: Registry, accelerator: Any) -> Accelerator:
    from fabric_core.accelerators.base import Accelerator

    if isinstance(accelerator, Accelerator):
        return accelerator
    if not isinstance(accelerator, str):
        raise TypeError(f"`accelerator` must be a name or an Accelerator instance, got {type(accelerator).__name__}.")
    name = accelerator.strip().lower()
    if name == "auto":
        name = registry.decisions.auto_accelerator() or "cpu"
    elif name == "gpu":
        for candidate in ("mps", "cuda"):
            if ("accelerator", candidate) in registry and registry.get("accelerator", candidate).load().is_available():
                name = candidate
                break
        else:
            raise RuntimeError("No supported gpu backend found! `accelerator='gpu'` needs CUDA or Apple MPS.")
    if ("accelerator", name) not in registry:
        raise ValueError(
            registry.unknown_name_message("accelerator", accelerator, special=("auto",))
            + " `accelerator='gpu'` is accepted too (MPS or CUDA, whichever is available)."
        )
    entry = registry.get("accelerator", name)
    cls = entry.load()
    if not cls.is_available():
        available = [n for n in registry.names("accelerator") if _safe_available(registry, n)]
        raise RuntimeError(
            f"`{cls.__qualname__}` can not run on your system since the accelerator is not available. The following"
            f" accelerator(s) is available and can be passed into `accelerator` argument of `Fabric`: {available}."
        )
    return entry.create()


def _safe_available(registry: Registry, name: str) -> bool:
    """Whether the accelerator ``name`` can be used here (for a message); a broken plugin's counts as unavailable."""
    from fabric_core.utilities.exceptions import guarded

    available, err = guarded(lambda: registry.get("accelerator", name).load().is_available())
    return err is None and bool(available)


class _UserPlugins(NamedTuple):
    """What the user passed in ``plugins=``."""

    precision: Precision | None = None
    environment: ClusterEnvironment | None = None
    checkpoint_io: CheckpointIO | None = None


def _check_strategy_instance(strategy: Strategy, accelerator: Any, user: _UserPlugins) -> None:
    """A setting given both on a strategy object and through another argument is ambiguous: refuse it."""
    both = "Keep it on the strategy object or pass it to Fabric, not both."
    if strategy.accelerator is not None and accelerator not in ("auto", None):
        raise ValueError(f"accelerator set through both strategy class and accelerator flag, choose one. {both}")
    if strategy.configured_precision is not None and user.precision is not None:
        raise ValueError(f"precision set through both strategy class and plugins, choose one. {both}")
    if strategy.configured_checkpoint_io is not None and user.checkpoint_io is not None:
        raise ValueError(f"checkpoint_io set through both strategy class and plugins, choose one. {both}")
    if strategy.cluster_environment is not None and user.environment is not None:
        raise ValueError(f"cluster_environment set through both strategy class and plugins, choose one. {both}")
    _check_parallel_devices(strategy, accelerator)


def torch_device_type(device: Any) -> str:
    """``"cuda"`` for ``torch.device("cuda:1")``, ``"cuda:1"`` or ``"cuda"``."""
    return str(device).split(":", 1)[0]


def _check_parallel_devices(strategy: Strategy, accelerator: Any) -> None:
    """A strategy object's own ``parallel_devices`` must be of the device type the ``accelerator`` flag names."""
    from fabric_core.accelerators.base import Accelerator

    devices = strategy.parallel_devices
    if not devices:
        return
    device_type = torch_device_type(devices[0])
    if isinstance(accelerator, Accelerator):
        compatible = accelerator.device_type == device_type
    elif isinstance(accelerator, str):
        name = accelerator.strip().lower()
        compatible = name in ("auto", device_type) or name == "gpu" and device_type in ("cuda", "mps")
    else:
        compatible = True  # not an accelerator: resolving it gives the error
    if not compatible:
        label = {"cpu": "CPU", "cuda": "GPU", "mps": "GPU"}.get(str(device_type), str(device_type).upper())
        raise ValueError(
            f"{label} parallel_devices set through {type(strategy).__name__} class, but accelerator set to"
            f" {accelerator}, please choose one device type: drop `accelerator=`, or give the strategy devices"
            " of that type."
        )


def _parallel_devices_accelerator(registry: Registry, strategy: Strategy, accelerator: Any) -> Any:
    """``accelerator="auto"``/``"gpu"`` with a strategy object that has its own devices: their device type."""
    devices = strategy.parallel_devices
    if not devices or not isinstance(accelerator, str) or accelerator.strip().lower() not in ("auto", "gpu"):
        return accelerator
    device_type = torch_device_type(devices[0])
    return device_type if ("accelerator", str(device_type)) in registry else accelerator


def resolve_strategy(
    registry: Registry,
    strategy: Any,
    accelerator: Accelerator,
    num_devices: int,
    num_nodes: int,
    interactive: bool | None = None,
) -> Strategy:
    """The strategy object for a name, built but not bound: ``strategy="auto"`` answered by the hook, then the owning
    plugin's adjustment, then the registered class with its registered options.

    ``Fabric(...)`` and ``fabric run`` (which only reads the class's launcher) both decide through it.
    ``interactive`` defaults to whether this process is interactive (a notebook picks a forking strategy).
    """
    from fabric_core.strategies.base import Strategy

    choice = choose_strategy(registry, strategy, accelerator, num_devices, num_nodes, interactive)
    return choice if isinstance(choice, Strategy) else registry.create("strategy", choice)


def choose_strategy(
    registry: Registry,
    strategy: Any,
    accelerator: Accelerator,
    num_devices: int,
    num_nodes: int,
    interactive: bool | None = None,
) -> str | Strategy:
    """The registered name :func:`resolve_strategy` builds (after ``"auto"`` and the owning plugin's adjustment, so
    ``"dp"`` on CPUs is ``"ddp"``), or the object the ``"auto"`` hook answered with."""
    from fabric_core.strategies.base import Strategy

    if not isinstance(strategy, str):
        raise TypeError(f"`strategy` must be a name or a Strategy instance, got {type(strategy).__name__}.")
    name = strategy.strip().lower()
    if name == "auto":
        interactive = is_interactive() if interactive is None else interactive
        answer = registry.decisions.auto_strategy(accelerator, num_devices, num_nodes, interactive)
        if answer is None:
            raise ValueError(_no_auto_strategy_message(registry, accelerator, num_devices, num_nodes))
        if isinstance(answer, Strategy):
            return answer
        name = str(answer).lower()
    adjusted = registry.decisions.adjust_strategy(name, accelerator, num_devices, num_nodes)
    return adjusted or name


def _no_auto_strategy_message(registry: Registry, accelerator: Accelerator, num_devices: int, num_nodes: int) -> str:
    message = (
        f"No installed strategy can run {num_devices} device(s) on {num_nodes} node(s) with the"
        f" {accelerator.name} accelerator (`strategy='auto'`). Pass a strategy name, or `devices=1`."
    )
    missing = registry.hinted_distributions("strategy")
    for dist, names in sorted(missing.items()):
        message += f" {dist} ({', '.join(n for n in names if '*' not in n)}): {registry.install_hint(dist)}"
    return message + f" Installed strategies: {', '.join(registry.names('strategy'))}."


def _resolve_precision(
    registry: Registry, precision: Any, user: _UserPlugins, strategy: Strategy, accelerator: Accelerator
) -> Precision:
    """The user's precision object, the strategy's own, the strategy's answer for the name, or the hook's."""
    if user.precision is not None:
        return user.precision
    own = strategy.configured_precision
    if own is not None:
        # A `precision=` flag that the strategy's own precision would silently override is a user error.
        if precision is not None and _precision_name(registry, precision) != own.precision:
            raise ValueError(
                f"precision set through both the strategy object ({own!r}) and `precision={precision!r}`, choose one."
            )
        return own
    name = _precision_name(registry, precision)
    answer = strategy.precision_for(name, accelerator)
    if answer is None:
        answer = registry.decisions.select_precision(name, strategy, accelerator)
    if answer is None:
        raise _unknown_precision(registry, precision, strategy)
    return answer


def _interactive_message(registry: Registry, strategy: Any, accelerator: Accelerator, num_devices: int, num_nodes: int) -> str:
    """The reference's words, with the strategy ``strategy="auto"`` picks in a notebook as the compatible choice."""
    answer = registry.decisions.auto_strategy(accelerator, num_devices, num_nodes, True)
    choice = f"`Fabric(strategy={answer!r})`" if isinstance(answer, str) else "a strategy whose processes are forked"
    return (
        f"`Fabric(strategy={strategy!r})` is not compatible with an interactive environment. Run your code as a"
        f" script, or choose one of the compatible strategies: {choice} (`fabric plugins --kind strategy` describes"
        " each). In case you are spawning processes yourself, make sure to include the Fabric creation inside the"
        " worker function. An interactive environment is a notebook or `python -i`."
    )


def _counts_to_validate(devices: Any, env: ClusterEnvironment) -> bool:
    """Whether ``devices``/``num_nodes`` are checked against the environment's own counts.

    Not for ``devices="auto"`` under a launcher that owns the world size (torchrun, SLURM, ...): "auto" states no
    count (it means every device of the node, possibly more than the launcher's processes per node), and the
    launcher's world size is what the job uses. Where the world size follows ``devices`` (the fallback
    environment under ``LOCAL_RANK``), a contradiction breaks the job whatever ``devices`` says, so it is checked.
    """
    auto = isinstance(devices, str) and devices.strip().lower() == "auto"
    return not (auto and env.creates_processes_externally and not getattr(env, "ranks_follow_devices", False))


def _check_devices_requested(devices: Any, accelerator: Any) -> None:
    """``devices`` of ``0``/``"0"``/``[]`` is refused before the accelerator is looked at (as the reference does),
    so the error is about ``devices`` even where the accelerator is not available."""
    from fabric_core.accelerators.base import Accelerator, no_devices_message, requests_no_devices

    if requests_no_devices(devices):
        name = type(accelerator).__qualname__ if isinstance(accelerator, Accelerator) else accelerator
        raise ValueError(no_devices_message(devices, name))


def resolve(
    *,
    accelerator: Any,
    strategy: Any,
    devices: Any,
    num_nodes: Any,
    precision: Any,
    plugins: Any,
) -> Resolved:
    """Resolve all arguments (after CLI overrides): one step per decision, each answered through a hook, then one
    binding step (:meth:`Strategy.bind <fabric_core.strategies.base.Strategy.bind>`) that hands the strategy
    everything decided."""
    from fabric_core.strategies.base import Binding, Strategy

    registry = get_registry()
    args = apply_torchrun_variables(apply_cli_settings(
        {"accelerator": accelerator, "strategy": strategy, "devices": devices, "num_nodes": num_nodes, "precision": precision}
    ))
    accelerator, strategy, devices, num_nodes, precision = (args[k] for k in ("accelerator", "strategy", "devices", "num_nodes", "precision"))
    # `fabric run --num-nodes MIN:MAX`: this attempt's count comes from the launcher below; strategies are chosen for
    # the largest world (a job that shrank to one process is still a data-parallel job)
    node_range = num_nodes if isinstance(num_nodes, tuple) else None
    if node_range is not None:
        num_nodes = node_range[1]
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"`num_nodes` must be a positive integer, but got {num_nodes!r}.")
    user = _UserPlugins(*_split_plugins(plugins))
    if precision is not None and user.precision is not None:
        raise ValueError(
            f"Received both `precision={precision}` and `plugins={user.precision!r}`. Choose one: the precision"
            " plugin already says which precision to use."
        )

    strategy_obj = strategy if isinstance(strategy, Strategy) else None
    if strategy_obj is not None:
        _check_strategy_instance(strategy_obj, accelerator, user)
        accelerator = strategy_obj.accelerator or _parallel_devices_accelerator(registry, strategy_obj, accelerator)

    _check_devices_requested(devices, accelerator)
    accelerator_obj = resolve_accelerator(registry, accelerator)
    device_list = accelerator_obj.parse_devices(devices)
    environment = (
        user.environment
        or (strategy_obj.cluster_environment if strategy_obj is not None else None)
        or registry.decisions.detect_cluster_environment()
    )
    if strategy_obj is None:
        choice = choose_strategy(registry, strategy, accelerator_obj, len(device_list), num_nodes)
        strategy_obj = choice if isinstance(choice, Strategy) else registry.create("strategy", choice)
        strategy = choice if isinstance(choice, str) else strategy  # the strategy used, named as the reference does
    if node_range is not None:
        num_nodes = elastic_node_count(node_range, environment, len(device_list))
    precision_obj = _resolve_precision(registry, precision, user, strategy_obj, accelerator_obj)
    precision_obj.configure(accelerator_obj.device_type)
    # The one binding step: the strategy receives every decision at once and is complete on return.
    strategy_obj.bind(
        Binding(
            accelerator=accelerator_obj,
            devices=device_list,
            num_nodes=num_nodes,
            cluster_environment=environment,
            checkpoint_io=user.checkpoint_io,
            precision=precision_obj,
            select_launcher=registry.decisions.select_launcher,
            registered_formats=registry.registered_formats(),
        )
    )

    launcher = strategy_obj.launcher
    if launcher is not None and is_interactive() and not launcher.is_interactive_compatible:
        raise RuntimeError(_interactive_message(registry, strategy, accelerator_obj, len(device_list), num_nodes))
    env = strategy_obj.cluster_environment
    if env is not None and strategy_obj.requires_launch and _counts_to_validate(devices, env):
        # At construction, for every launcher (docs/decisions.md, "Devices and environments"): a mismatch found
        # later shows up as a rendezvous that hangs.
        env.validate_settings(num_devices=len(device_list), num_nodes=num_nodes)
    return Resolved(accelerator_obj, strategy_obj, precision_obj, device_list, num_nodes)


def resolve_loggers(loggers: Any) -> list[Any]:
    """``Fabric(loggers=...)``: registered names, ``{name: options}`` mappings and logger objects, in the given order.

    A name is built by its plugin (``target(**defaults, **options)``); an object is accepted by interface, as the
    reference accepts it (:data:`fabric_core.loggers.base.REQUIRED_MEMBERS`). ``None`` means no logger.
    """
    from collections.abc import Mapping

    items = [] if loggers is None else list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
    resolved: list[Any] = []
    for item in items:
        if isinstance(item, str):
            resolved.append(_logger_by_name(item, {}))
        elif isinstance(item, Mapping):
            for name, options in item.items():
                if not isinstance(name, str) or not (options is None or isinstance(options, Mapping)):
                    raise TypeError(
                        f"`Fabric(loggers=...)` got {{{name!r}: {options!r}}}: options go as {{name: {{option: value}}}},"
                        " e.g. `loggers={'wandb': {'project': 'lm'}}`."
                    )
                resolved.append(_logger_by_name(name, dict(options or {})))
        else:
            complaint = _logger_complaint(item)
            if complaint:
                raise TypeError(f"`Fabric(loggers=...)` got {item!r}: {complaint}")
            resolved.append(item)
    return resolved


def _logger_by_name(name: str, options: dict[str, Any]) -> Any:
    import inspect

    registry = get_registry()
    try:
        entry = registry.get("logger", name.strip())
    except ValueError as err:
        raise ValueError(f"`Fabric(loggers=...)` got {name!r}: {err}") from None
    cls = entry.load()  # a tracker that cannot be imported: PluginImportError naming its distribution
    try:
        return entry.create(**options)
    except TypeError as err:
        try:
            accepted = ", ".join(p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs"))
        except (TypeError, ValueError):
            accepted = "see its documentation"
        raise TypeError(
            f"The logger {entry.name!r} ({cls.__module__}.{cls.__qualname__}, from {entry.distribution}) could not be"
            f" built with the options {options!r}: {err}. Its options: {accepted}."
        ) from err


def _logger_complaint(item: Any) -> str | None:
    """Loggers are accepted by interface (as the reference does): any object with its abstract members."""
    from fabric_core.loggers.base import REQUIRED_MEMBERS, missing_members

    members = ", ".join(f"`{m}`" for m in REQUIRED_MEMBERS)
    if isinstance(item, type):
        if not missing_members(item):
            return f"pass an instance, e.g. `{item.__name__}(...)`, not the class."
        return "a logger is an instance of a logger class, such as `fabric_core.loggers.CSVLogger(root_dir=...)`."
    missing = missing_members(item)
    if not missing:
        return None
    if isinstance(item, (bytes, int, float, bool)):
        return (
            "a logger is a registered name (`'csv'`, `'tensorboard'`, ...: `fabric plugins --kind logger`), a logger"
            f" object such as `fabric_core.loggers.CSVLogger(root_dir=...)`, or any object with {members}."
        )
    return (
        f"{type(item).__name__} has no {', '.join(f'`{m}`' for m in missing)}. A logger needs the members of the"
        f" reference's Logger interface: {members} (subclass `fabric_core.loggers.Logger` to get defaults for the rest)."
    )
