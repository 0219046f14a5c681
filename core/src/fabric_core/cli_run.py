"""``fabric run``: start a training script on every device of this node through torch's elastic launcher.

``fabric run train.py --devices 2 --lr 0.1`` runs ``train.py --lr 0.1`` in two processes. Fabric's own options
are recognised anywhere on the line, before or after SCRIPT (as the well-known CLI does); every other argument
after SCRIPT goes to the script, in order, and ``--`` ends Fabric's options (``fabric run train.py -- --devices
8`` hands ``--devices 8`` to the script). Torch's elastic agent (what ``torchrun`` is) starts and watches the
processes: if one fails, the others are stopped and the command exits non-zero. Inside each process
``Fabric(...)`` sees ``FABRIC_CLI_USED=1``, takes its accelerator, strategy, devices, num_nodes and precision from
the ``FABRIC_*`` variables set here, and joins the process group in its constructor, so the script must not call
``fabric.launch()``.

Which strategies ``fabric run`` accepts is decided by the strategy classes, not by their names: a strategy whose
launcher can only run a function (it creates its processes itself) is refused with the
reason; a strategy without a launcher runs as one process driving every device.

Several nodes: run the same command on each with ``--num-nodes``, its own ``--node-rank`` and the address and
port of node 0 (``--main-address``/``--main-port``). As torchrun does, an option not given takes its value from
torchrun's variable for it (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_RDZV_BACKEND``, ...: :mod:`fabric_core.environments.torchrun_variables`), which Kubeflow sets in every pod.

Other launchers: ``--launcher NAME`` hands the job to a launcher a plugin registered with ``runs_scripts = True``
(:meth:`fabric_core.launchers.base.Launcher.run_script`), which starts every node's processes from this one command
(on a cluster scheduler, for example) and takes its own options as ``--NAME-KEY VALUE`` before SCRIPT. The core
names no such launcher; without ``--launcher`` (or with ``--launcher torchrun``) nothing changes.

Usage errors print ``fabric run: error: ...`` and exit with status 2; ``--help`` prints the options and exits 0. Both
start with ``Usage: fabric run [OPTIONS] SCRIPT [SCRIPT_ARGS]...``, the reference's (click's) first line.
This module imports torch only when a run really starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from fabric_core.environments import torchrun_variables
from fabric_core.environments.torchrun_variables import node_count
from fabric_core.launchers.base import CLI_FLAG, CLI_SETTINGS
from fabric_core.utilities.topology import threads_per_process

DEFAULT_MAIN_PORT = 29400
#: torch's switch that makes every rendezvous round of an elastic job publish its own store (set for MIN:MAX).
ELASTIC_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
USAGE = "fabric run [OPTIONS] SCRIPT [SCRIPT_ARGS]...\n       fabric run [OPTIONS] -m MODULE [ARGS]..."


@dataclass(frozen=True)
class _Option:
    """One ``fabric run`` option, declared once: parsing, :class:`RunArgs`, the help, and where its value goes (the
    script's ``Fabric(...)`` or torchrun's command line) all derive from this."""

    dest: str
    flags: tuple[str, ...]
    help: str
    default: Any = None
    type: Any = str
    takes_value: bool = True
    #: recognised only before SCRIPT (after it, the token is the script's: many scripts have a `--log-dir`)
    before_script: bool = False
    #: torchrun's flag this option is passed on as (``None``: Fabric's own option)
    torchrun: str | None = None
    #: how the value reaches torchrun: "given" (``FLAG=VALUE`` when set), "always" (default included) or "rendezvous"
    #: (combined with the main address and port into where the processes meet, :func:`_rendezvous_arguments`)
    forward: str = "given"
    #: passed to the script's ``Fabric(...)`` through its ``FABRIC_*`` variable (:data:`CLI_SETTINGS`) when set
    fabric_setting: bool = False
    #: torchrun's variable for the option where torchrun names it otherwise (default: from :attr:`torchrun`)
    environ: str | None = None

    @property
    def variable(self) -> str | None:
        """The ``PET_*`` variable whose value the option takes where it is not given, as torchrun takes it."""
        return self.environ or (torchrun_variables.variable_for(self.torchrun) if self.torchrun else None)


OPTIONS = (
    _Option("accelerator", ("--accelerator",), "the hardware to run on (default: what the script's Fabric(...) says, else auto)", fabric_setting=True),
    _Option("strategy", ("--strategy",), "the strategy; one that starts its own processes from a function is refused", fabric_setting=True),
    _Option("devices", ("--devices",), "devices (processes) per node: a number, 'auto', or GPU indices such as '0,1' (default: 1)", "1", fabric_setting=True, environ=torchrun_variables.NPROC_PER_NODE),
    _Option("num_nodes", ("--num-nodes", "--num_nodes"), "number of nodes, or MIN:MAX for an elastic job that goes on when nodes leave and grows when they join (c10d rendezvous at --main-address:--main-port unless --rdzv-backend says otherwise; default: 1)", 1, node_count, fabric_setting=True, environ=torchrun_variables.NNODES),
    _Option("node_rank", ("--node-rank", "--node_rank"), "index of this node, 0 = main (default: 0)", 0, int, environ=torchrun_variables.NODE_RANK),
    _Option("main_address", ("--main-address", "--main_address"), "address of node 0, where the processes meet (default: 127.0.0.1)", "127.0.0.1", environ=torchrun_variables.MASTER_ADDR),
    _Option("main_port", ("--main-port", "--main_port"), f"a free port on node 0 (default: {DEFAULT_MAIN_PORT})", DEFAULT_MAIN_PORT, int, environ=torchrun_variables.MASTER_PORT),
    _Option("precision", ("--precision",), "the precision (default: what the script's Fabric(...) says, else 32-true)", fabric_setting=True),
    _Option("hang_timeout", ("--hang-timeout", "--hang_timeout"), "end the job when a rank makes no progress for this many seconds, naming it and its line (FABRIC_HANG_TIMEOUT; default: off)", None, float, before_script=True),
    _Option("launcher", ("--launcher",), "who starts the processes: torchrun (default: torch's elastic launcher, run on every node) or a registered script launcher that starts the whole job from here (`fabric plugins --kind launcher`); its own options are --NAME-KEY VALUE, before SCRIPT", None, before_script=True),
    _Option("module", ("-m", "--module"), "treat SCRIPT as a module name and run it like `python -m MODULE` (before SCRIPT)", False, bool, False, before_script=True),
)  # fmt: skip
#: torchrun's restart, rendezvous and logging options, passed on unchanged (only before SCRIPT, as with torchrun), in
#: this order.
ELASTIC_OPTIONS = (
    _Option("standalone", ("--standalone",), "one node: a local rendezvous on a free port (--main-address/--main-port unused)", False, bool, False, before_script=True, torchrun="--standalone", forward="rendezvous"),
    _Option("rdzv_backend", ("--rdzv-backend", "--rdzv_backend"), "rendezvous backend: static (default: --main-address/--main-port, --node-rank), c10d, etcd, etcd-v2", None, before_script=True, torchrun="--rdzv-backend", forward="rendezvous"),
    _Option("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"), "HOST[:PORT] of the rendezvous backend (default for c10d: --main-address:--main-port)", None, before_script=True, torchrun="--rdzv-endpoint", forward="rendezvous"),
    # notice a failed worker within 0.1 s by default (older torch defaulted to 5 s)
    _Option("monitor_interval", ("--monitor-interval", "--monitor_interval"), "seconds between checks of the workers (default: 0.1)", 0.1, float, before_script=True, torchrun="--monitor-interval", forward="always"),
    _Option("max_restarts", ("--max-restarts", "--max_restarts"), "restart all workers up to N times when one fails (default: 0)", 0, int, before_script=True, torchrun="--max-restarts", forward="always"),
    _Option("rdzv_id", ("--rdzv-id", "--rdzv_id"), "job id shared by every node of the job (non-static backends)", None, before_script=True, torchrun="--rdzv-id"),
    _Option("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"), "extra rendezvous settings, KEY=VALUE,... (e.g. join_timeout=600)", None, before_script=True, torchrun="--rdzv-conf"),
    _Option("log_dir", ("--log-dir", "--log_dir"), "folder for the workers' log files (with --redirects/--tee)", None, before_script=True, torchrun="--log-dir"),
    _Option("redirects", ("-r", "--redirects"), "send workers' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or LOCAL_RANK:N,...", None, before_script=True, torchrun="--redirects"),
    _Option("tee", ("-t", "--tee"), "copy workers' streams to log files too (same values as --redirects)", None, before_script=True, torchrun="--tee"),
    _Option("local_ranks_filter", ("--local-ranks-filter", "--local_ranks_filter"), "show only these local ranks' output on the console, e.g. 0 or 0,1", None, before_script=True, torchrun="--local-ranks-filter"),
    _Option("local_addr", ("--local-addr", "--local_addr"), "address of this node for the rendezvous (default: its host name)", None, before_script=True, torchrun="--local-addr"),
)  # fmt: skip
ALL_OPTIONS = (*OPTIONS, *ELASTIC_OPTIONS)
_BY_FLAG = {flag: option for option in ALL_OPTIONS for flag in option.flags}
_BY_DEST = {option.dest: option for option in ALL_OPTIONS}
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
#: torchrun's stream selection: one of 0-3 for every local rank, or LOCAL_RANK:N pairs.
_STREAMS = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")


class CLIError(Exception):
    """A bad command line or a bad combination of options; reported as ``fabric run: error: ...``, exit status 2."""


class _Help(Exception):
    """``--help`` was asked for."""


#: What ``fabric run`` was asked to do: ``script``, ``script_args``, and one field per option of :data:`ALL_OPTIONS`
#: (named by its ``dest``, with its default).
RunArgs = make_dataclass(
    "RunArgs",
    [
        ("script", str, field(default="")),
        ("script_args", list, field(default_factory=list)),
        *((option.dest, option.type, field(default=option.default)) for option in ALL_OPTIONS),
        # the script launcher's own options (``--NAME-KEY VALUE`` with ``--launcher NAME``): {"key": "VALUE"}
        ("launcher_options", dict, field(default_factory=dict)),
    ],
)
RunArgs.__module__ = __name__
RunArgs.__doc__ = "What ``fabric run`` was asked to do (one field per option of ``ALL_OPTIONS``)."


def help_text() -> str:
    lines = [f"Usage: {USAGE}", "", "Run SCRIPT in --devices processes on this node (and --num-nodes nodes) with torch's"]
    lines += [
        "elastic launcher. Fabric(...) in the script takes the options given here and joins the process group by",
        "itself, so the script must not call fabric.launch(). Options may come before or after SCRIPT; other",
        "arguments after SCRIPT are passed to it unchanged, and `--` passes everything after it to the script.",
        "",
        "options:",
        "  -h, --help            show this help message and exit",
    ]
    for option in OPTIONS:
        lines.append(_help_line(option))
    lines += ["", "torchrun's restart, rendezvous and logging options (before SCRIPT; passed on to torchrun):"]
    for option in ELASTIC_OPTIONS:
        lines.append(_help_line(option))
    return "\n".join(lines) + "\n"


def _help_line(option: _Option) -> str:
    flags = ", ".join(option.flags) + (" VALUE" if option.takes_value else "")
    return f"  {flags:<22}{' ' if len(flags) < 22 else chr(10) + ' ' * 24}{option.help}"


def parse_run_args(argv: Sequence[str]) -> RunArgs:
    """Parse ``fabric run``'s command line: Fabric's options anywhere, the rest after SCRIPT to the script."""
    args = RunArgs()
    given: set[str] = set()
    tokens = list(argv)
    unknown: list[tuple[str, str]] = []  # options before SCRIPT that may be the script launcher's (--NAME-KEY VALUE)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            rest = tokens[i:]
            if not args.script:
                if not rest:
                    raise CLIError("missing SCRIPT after `--`.")
                args.script, rest = rest[0], rest[1:]
            args.script_args.extend(rest)
            break
        if token in ("-h", "--help"):
            raise _Help()
        flag, has_inline, inline = token.partition("=")
        option = _BY_FLAG.get(flag) if token.startswith("-") else None
        if option is not None and not (option.before_script and args.script):
            if not option.takes_value:
                if has_inline:
                    raise CLIError(f"option {flag} takes no value.")
                setattr(args, option.dest, True)
                given.add(option.dest)
                continue
            if has_inline:
                value = inline
            elif i < len(tokens):
                value, i = tokens[i], i + 1
            else:
                raise CLIError(f"option {flag} needs a value.")
            try:
                setattr(args, option.dest, option.type(value))
            except ValueError as err:
                if option.type is node_count:
                    raise CLIError(f"option {flag}: {value!r} is not a number of nodes N or a range MIN:MAX with 0 < MIN <= MAX.") from None
                raise CLIError(f"option {flag}: invalid {option.type.__name__} value {value!r}.") from err
            given.add(option.dest)
            continue
        if not args.script:
            if token.startswith("--") and len(token) > 2:
                if has_inline:
                    unknown.append((flag, inline))
                elif i < len(tokens):
                    unknown.append((flag, tokens[i]))
                    i += 1
                else:
                    unknown.append((flag, ""))
                continue
            if token.startswith("-") and token != "-":
                raise CLIError(f"unknown option {token!r} before SCRIPT (options for the script go after it).")
            args.script = token
        else:
            args.script_args.append(token)
    for flag, value in unknown:  # known only now: `--launcher NAME` may come after the launcher's own options
        prefix = launcher_option_prefix(args.launcher) if args.launcher else None
        spelled = flag.lower().replace("_", "-")
        if prefix is None or not spelled.startswith(prefix) or len(spelled) == len(prefix):
            raise CLIError(f"unknown option {flag!r} before SCRIPT (options for the script go after it).")
        if not value:
            raise CLIError(f"option {flag} needs a value.")
        args.launcher_options[spelled[len(prefix) :].replace("-", "_")] = value
    if not args.script:
        raise CLIError("missing SCRIPT: the script (or, with -m, the module) to run.")
    take_torchrun_variables(args, given)
    return args


def take_torchrun_variables(args: RunArgs, given: set[str]) -> None:
    """Give every option not on the command line the value of its ``PET_*`` variable, where set, as torchrun does."""
    for option in ALL_OPTIONS:
        name = option.variable
        text = torchrun_variables.get(name) if name and option.dest not in given else None
        if text is None:
            continue
        try:
            if option.dest == "num_nodes":
                value: Any = torchrun_variables.parse_nodes(text, name)
            elif option.dest == "devices":
                value = str(torchrun_variables.parse_processes_per_node(text, name))
            elif option.type is bool:
                value = bool(int(text))  # torchrun's reading of a flag's variable
            else:
                value = option.type(text)
        except ValueError as err:
            raise CLIError(str(err) if name in str(err) else f"{name}={text!r} is not a valid value for {option.flags[0]}.") from None
        setattr(args, option.dest, value)
    if isinstance(args.num_nodes, tuple):
        low, high = args.num_nodes
        if low == high:
            args.num_nodes = high
        elif "num_nodes" in given:
            # `--num-nodes MIN:MAX` asks for an elastic job: torchrun's c10d rendezvous, where the main node is
            if args.rdzv_backend is None and not args.standalone:
                args.rdzv_backend = "c10d"
        elif _static_rendezvous(args):
            # PET_NNODES=MIN:MAX with the static rendezvous, which waits for MAX nodes (its `max_nodes`): that world
            args.num_nodes = high


def max_nodes(args: Any) -> int:
    """The most nodes the job has: ``--num-nodes``, or MAX of an elastic ``MIN:MAX``."""
    return args.num_nodes[1] if isinstance(args.num_nodes, tuple) else args.num_nodes


def nodes_text(args: Any) -> str:
    """``--num-nodes`` as torchrun and ``FABRIC_NUM_NODES`` spell it: ``N`` or ``MIN:MAX``."""
    return ":".join(map(str, args.num_nodes)) if isinstance(args.num_nodes, tuple) else str(args.num_nodes)


def launcher_option_prefix(launcher: str) -> str:
    """``--NAME-``: how a script launcher's own options start (``_`` and ``-`` alike, any case)."""
    return f"--{launcher.lower().replace('_', '-')}-"


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command to the ``fabric`` parser (for its help; :func:`main` parses the line itself)."""
    parser = subparsers.add_parser(
        "run",
        usage=USAGE,
        add_help=False,
        help="run a script on several devices/nodes (Fabric(...) picks the settings up; no launch() needed)",
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda parsed: main(parsed.argv))
    return parser


# ------------------------------------------------------------------------------------------------- decisions
def _registry() -> Any:
    from fabric_core.plugins.host import get_registry

    return get_registry()


def _check_installed(kind: str, name: str | None) -> None:
    if name is None or (kind == "accelerator" and name.lower() in ("auto", "gpu")):
        return
    registry = _registry()
    if (kind, name) not in registry:
        raise CLIError(registry.unknown_name_message(kind, name))


def processes_per_node(
    accelerator: str | None, strategy: str | None, devices: str, num_nodes: int = 1
) -> tuple[int, str]:
    """How many processes to start on this node, and the ``devices`` value each script's Fabric gets.

    The strategy decides: its launcher must be able to re-run a script (not only a function), and a strategy
    without a launcher is one process that drives every device itself.
    """
    from fabric_core.accelerators.base import no_devices_message, requests_no_devices
    from fabric_core.connector import resolve_accelerator, resolve_strategy

    if requests_no_devices(devices):  # before the accelerator, as `Fabric(devices=0)` does
        raise CLIError(no_devices_message(devices, (accelerator or "auto").lower()))
    registry = _registry()
    try:
        accelerator_obj = resolve_accelerator(registry, (accelerator or "auto").lower())
        device_list = accelerator_obj.parse_devices(devices)
    except (TypeError, ValueError, RuntimeError) as err:
        raise CLIError(str(err)) from None
    count = len(device_list)
    try:  # the same decision as `Fabric(strategy=...)` (the CLI itself is never interactive)
        strategy_obj = resolve_strategy(registry, strategy or "auto", accelerator_obj, count, num_nodes, interactive=False)
    except (TypeError, ValueError, ImportError) as err:
        raise CLIError(str(err)) from None
    launcher_name = strategy_obj.launcher_name
    if launcher_name is None:
        return 1, devices  # one process drives every device (or there is only one)
    try:
        launcher_cls = registry.get("launcher", launcher_name).load()
    except (ValueError, ImportError) as err:
        raise CLIError(str(err)) from None
    if launcher_cls.requires_function:
        label = strategy or type(strategy_obj).__name__
        raise CLIError(
            f"The strategy {label!r} starts its processes itself and runs a function in them ({launcher_name!r}"
            f" launcher), so `fabric run` cannot start it. Run the script with `python` and call"
            " `fabric.launch(fn)`, or choose a strategy that re-runs the script."
        )
    return count, devices  # "auto" stays "auto": each process resolves it as Fabric(devices="auto") would


def check_elastic(args: RunArgs) -> None:
    """Refuse torchrun options that torchrun would reject with a traceback, or that cannot work together."""
    if args.hang_timeout is not None and not args.hang_timeout >= 0:
        raise CLIError(f"--hang-timeout must be a number of seconds (0: off), got {args.hang_timeout}.")
    if args.max_restarts < 0:
        raise CLIError(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
    if not args.monitor_interval > 0:
        raise CLIError(f"--monitor-interval must be a positive number of seconds, got {args.monitor_interval}.")
    for name in ("redirects", "tee"):
        value = getattr(args, name)
        if value is not None and not _STREAMS.match(value):
            raise CLIError(
                f"--{name} takes 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every local rank or as"
                f" LOCAL_RANK:N,... (e.g. 0:3,1:2), got {value!r}."
            )
    backend = args.rdzv_backend
    if backend is not None and backend not in RDZV_BACKENDS:
        raise CLIError(f"--rdzv-backend must be one of {', '.join(RDZV_BACKENDS)}, got {backend!r}.")
    if isinstance(args.num_nodes, tuple) and (backend in (None, "static") or args.standalone):
        low, high = args.num_nodes
        raise CLIError(
            f"--num-nodes {low}:{high} lets nodes leave and join while the job runs, which needs an elastic rendezvous:"
            " drop --standalone/--rdzv-backend static (c10d at --main-address:--main-port is then used), or give a"
            " fixed number of nodes."
        )
    if args.standalone:
        if args.num_nodes != 1:
            raise CLIError("--standalone runs the rendezvous on this node alone: it cannot be used with --num-nodes > 1.")
        if backend is not None or args.rdzv_endpoint is not None or args.rdzv_id is not None:
            raise CLIError("--standalone chooses the rendezvous itself: drop --rdzv-backend, --rdzv-endpoint and --rdzv-id.")
    if (backend is None or backend == "static") and args.rdzv_endpoint is not None:
        raise CLIError(
            "--rdzv-endpoint is for the c10d/etcd backends (add --rdzv-backend c10d); the static rendezvous meets at"
            " --main-address/--main-port."
        )


#: ``--launcher`` default: torch's elastic agent, started on every node by the user (the code below this table).
DEFAULT_LAUNCHER = "torchrun"
#: Options that only torchrun understands, or that place one node: a script launcher places every node itself.
_NODE_LOCAL = ("node_rank", "main_address", "main_port")


def script_launcher(args: RunArgs) -> type | None:
    """The class of the script launcher ``--launcher`` names, ``None`` for torchrun.

    The core knows no launcher but torchrun: any plugin may register a ``launcher`` whose class has
    ``runs_scripts = True`` (:meth:`~fabric_core.launchers.base.Launcher.run_script`), so ``fabric run`` can start a
    job on a cluster scheduler from one command; its options arrive as ``--NAME-KEY VALUE``.
    """
    name = args.launcher
    if name is None or name.lower() == DEFAULT_LAUNCHER:
        if args.launcher_options:
            raise CLIError(f"torchrun takes no {launcher_option_prefix(DEFAULT_LAUNCHER)}... options; its own are listed by `fabric run --help`.")
        return None
    registry = _registry()
    entry = registry.lookup("launcher", name)
    cls = _load_quietly(entry)
    if cls is None or not getattr(cls, "runs_scripts", False):
        valid = [DEFAULT_LAUNCHER, *(n for n in registry.names("launcher") if getattr(_load_quietly(registry.lookup("launcher", n)), "runs_scripts", False))]
        why = "runs a function in processes of its own, not a script" if cls is not None else "is not registered"
        message = f"--launcher {name!r} {why}. `fabric run --launcher` takes: {', '.join(valid)}."
        dist = registry.distribution_for("launcher", name)
        if cls is None and dist is not None:
            message += f" {registry.install_hint(dist)}"
        elif cls is None:  # a typo of a script launcher's name, installed or not (`fabric run --launcher rya`)
            installed = set(registry.all_names("launcher"))
            hinted = [h.pattern for h in registry.hints if h.kind == "launcher" and not h.is_pattern and h.pattern not in installed]
            close = difflib.get_close_matches(name.lower(), [*valid, *hinted], n=1, cutoff=0.5)
            if close:
                message += f" Did you mean {close[0]!r}?"
                if close[0] not in valid and registry.distribution_for("launcher", close[0]) is not None:
                    message += f" {registry.install_hint(registry.distribution_for('launcher', close[0]))}"
        raise CLIError(message)
    given = [_BY_DEST[dest].flags[0] for dest in _NODE_LOCAL if getattr(args, dest) != _BY_DEST[dest].default]
    given += [o.flags[0] for o in ELASTIC_OPTIONS if o.dest not in ("max_restarts", "monitor_interval") and getattr(args, o.dest) != o.default]
    if given:
        raise CLIError(
            f"{', '.join(given)}: torchrun's options, but --launcher {name!r} starts every node from this one command"
            f" (no per-node settings). Drop them; the launcher's own options are {launcher_option_prefix(name)}KEY VALUE."
        )
    return cls


def _load_quietly(entry: Any) -> type | None:
    if entry is None:
        return None
    from fabric_core.plugins.registry import PluginImportError

    try:
        return entry.load()
    except PluginImportError:  # a broken plugin's launcher is simply not offered (`fabric plugins` reports why)
        return None


def _static_rendezvous(args: Any) -> bool:
    return not args.standalone and args.rdzv_backend in (None, "static")


def _rendezvous_arguments(args: Any) -> list[str]:
    """Where the processes meet: torchrun's standalone rendezvous, the static one at the main address and port
    (the well-known CLI's flags), or a c10d/etcd backend that meets there unless given an endpoint."""
    if args.standalone:
        return [_BY_DEST["standalone"].torchrun]
    if _static_rendezvous(args):
        return [f"--node-rank={args.node_rank}", f"--master-addr={args.main_address}", f"--master-port={args.main_port}"]
    endpoint = args.rdzv_endpoint or f"{args.main_address}:{args.main_port}"
    return [f"{_BY_DEST['rdzv_backend'].torchrun}={args.rdzv_backend}", f"{_BY_DEST['rdzv_endpoint'].torchrun}={endpoint}"]


def torchrun_arguments(args: Any, nprocs: int) -> list[str]:
    """The command line given to torch's elastic launcher (``torch.distributed.run``), derived from the options'
    declarations (:attr:`_Option.forward`)."""
    command = [f"--nproc-per-node={nprocs}", f"--nnodes={nodes_text(args)}", *_rendezvous_arguments(args)]
    for option in ELASTIC_OPTIONS:
        value = getattr(args, option.dest)
        if option.forward == "always" or option.forward == "given" and value is not None:
            command.append(f"{option.torchrun}={value}")
    if args.module:
        command.append("-m")
    return [*command, args.script, *args.script_args]


def prepare_environment(args: RunArgs, nprocs: int, devices: str) -> dict[str, str]:
    """Set the variables every started process reads; returns what was set."""
    values = {CLI_FLAG: "1"}
    for option in ALL_OPTIONS:
        value = devices if option.dest == "devices" else getattr(args, option.dest)
        if option.dest == "num_nodes":
            value = nodes_text(args)  # MIN:MAX: each attempt's Fabric takes the count its launcher started
        if option.fabric_setting and value is not None:
            values[CLI_SETTINGS[option.dest]] = str(value)
    if args.hang_timeout is not None:
        from fabric_core.runtime.hang import HANG_TIMEOUT_VARIABLE

        values[HANG_TIMEOUT_VARIABLE] = f"{args.hang_timeout:g}"
    # One job id for all its workers and all their restarts (torchrun keeps this environment): the run's identity.
    # A job of several nodes (this command runs on each) derives it from where they meet, so all nodes agree.
    from fabric_core.runtime.run import job_environment

    meeting = None
    if max_nodes(args) > 1:
        meeting = f"{args.rdzv_endpoint or f'{args.main_address}:{args.main_port}'}/{args.rdzv_id or ''}"
    values.update(job_environment(new=True, rendezvous=meeting))
    os.environ.update(values)
    # One intra-op thread pool per process sharing the cores; oversubscription makes CPU runs many times slower.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nprocs)))
    return values


def run_main(args: RunArgs) -> int:
    """Run ``fabric run`` with parsed ``args``; returns the exit status."""
    try:
        if not args.module and not os.path.isfile(args.script):
            raise CLIError(f"SCRIPT {args.script!r} does not exist (use -m to run a module).")
        if max_nodes(args) < 1:
            raise CLIError(f"--num-nodes must be a positive integer, got {args.num_nodes}.")
        if not 0 <= args.node_rank < max_nodes(args):
            raise CLIError(f"--node-rank must be between 0 and {max_nodes(args) - 1}, got {args.node_rank}.")
        check_elastic(args)
        _check_installed("strategy", args.strategy)
        _check_installed("precision", args.precision)
        _check_installed("accelerator", args.accelerator)
        nprocs, devices = processes_per_node(args.accelerator, args.strategy, args.devices, max_nodes(args))
        launcher = script_launcher(args)
        if launcher is not None and isinstance(args.num_nodes, tuple):
            raise CLIError(
                f"--num-nodes {nodes_text(args)} (elastic) is for torchrun's agents, which come and go with their"
                f" nodes; --launcher {args.launcher!r} starts a fixed number of nodes: give one."
            )
    except CLIError as err:
        print(f"Usage: {USAGE}\nfabric run: error: {err}", file=sys.stderr)
        return 2
    environment = prepare_environment(args, nprocs, devices)
    if isinstance(args.num_nodes, tuple):
        # torch's c10d rendezvous shares one TCPStore between the rounds of an elastic job by default; a node that
        # joins a later round then waits for a store address that the round's rank 0 does not publish again (it
        # kept its own from round 0), and both agents time out after 60 s. Each round builds its own instead.
        os.environ.setdefault(ELASTIC_STORE_VARIABLE, "1")
    if launcher is not None:
        from fabric_core.launchers.base import ScriptRequest

        environment.setdefault("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
        request = ScriptRequest(
            script=args.script,
            script_args=list(args.script_args),
            module=args.module,
            processes_per_node=nprocs,
            num_nodes=args.num_nodes,
            max_restarts=args.max_restarts,
            environment=environment,
            options=dict(args.launcher_options),
        )
        return int(launcher.run_script(request))

    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from fabric_core.runtime import preemption

    with tempfile.TemporaryDirectory(prefix="fabric-run-") as scratch:
        # torchrun copies the failed worker's error file to its own (else it logs an error that it has none).
        own_error_file = "TORCHELASTIC_ERROR_FILE" not in os.environ
        if own_error_file:
            os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(scratch, "error.json")
        # A worker that saved for a preemption notice and exits for a requeue leaves a line here (checkpoint tiers).
        # Slurm's `--signal=USR1@90` warns every process of the job: the agent stops its workers with it (they save
        # and exit for a requeue) instead of dying of it.
        own = {preemption.MARKER_VARIABLE: os.path.join(scratch, "preempted"),
               "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}  # fmt: skip
        own = {key: value for key, value in own.items() if key not in os.environ}
        os.environ.update(own)
        marker = os.environ[preemption.MARKER_VARIABLE]
        try:
            torchrun(torchrun_arguments(args, nprocs))
        except SignalException as err:  # SIGINT/SIGTERM: the agent has already stopped the workers
            return preemption.requeue_exit_code() if os.path.exists(marker) else 128 + int(err.sigval)
        except ChildFailedError as err:
            return report_failed_workers(err)
        finally:
            if own_error_file:
                os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
            for key in own:
                os.environ.pop(key, None)
    return 0


def report_failed_workers(err: Any) -> int:
    """Print which worker failed first, with its own error (torchrun's summary may name a peer that only lost its
    connection), and return the exit status of the command: that worker's."""
    from fabric_core.launchers.processes import exit_status
    from fabric_core.runtime import failures

    found = []
    for rank, failure in sorted(err.failures.items()):
        code = exit_status(failure.exitcode)
        error = failures.read_error_file(failure.error_file)
        label = f"Rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
        found.append(failures.RankFailure(label, None, code, error))
    if not found:
        return 1
    sys.stderr.write(failures.report_failures(found))
    sys.stderr.flush()
    return failures.job_exit_code(found)


def main(argv: Sequence[str] | None = None) -> int:
    """``fabric run ...`` (also ``python -m fabric_core.cli_run ...``); returns the exit status."""
    try:
        args = parse_run_args(sys.argv[1:] if argv is None else argv)
    except _Help:
        sys.stdout.write(help_text())
        return 0
    except CLIError as err:
        print(f"Usage: {USAGE}\nfabric run: error: {err}", file=sys.stderr)
        return 2
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
