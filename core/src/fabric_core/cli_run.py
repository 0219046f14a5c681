"""``fabric run``: start a training script on every device of this node through torch's elastic launcher.

``fabric run --devices 2 train.py --lr 0.1`` runs ``train.py --lr 0.1`` in two processes. Torch's elastic agent
(what ``torchrun`` is) starts and watches them: if one fails, the others are stopped and the command exits
non-zero. Inside each process ``Fabric(...)`` sees ``FABRIC_CLI_USED=1``, takes its accelerator, strategy,
devices, num_nodes and precision from the ``FABRIC_*`` variables set here, and joins the process group in its
constructor, so the script must not call ``fabric.launch()``.

Several nodes: run the same command on each with ``--num-nodes``, its own ``--node-rank`` and the address and
port of node 0 (``--main-address``/``--main-port``).

The :mod:`fabric_core.cli` module builds the ``fabric`` parser and calls :func:`add_run_parser` and
:func:`run_main`; this module imports torch only when a run really starts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from fabric_core.connector import _CLI_SETTINGS, CLI_FLAG

#: Strategies that cannot be started by ``fabric run``: they create their own processes or need a function.
_NOT_FOR_CLI = re.compile(r"spawn|fork|notebook|xla|tpu|offload")
_TPU_NAMES = ("tpu", "xla")
DEFAULT_MAIN_PORT = 29400

_USAGE = "fabric run [OPTIONS] SCRIPT [SCRIPT_ARGS]...\n       fabric run [OPTIONS] -m MODULE [ARGS]..."


def _registry() -> Any:
    from fabric_core.registry import get_registry

    return get_registry()


def _known(kind: str) -> list[str]:
    """Names of ``kind`` that are installed or belong to one of this project's distributions."""
    from fabric_core.registry import KNOWN_DISTRIBUTIONS

    names = set(_registry().all_names(kind))
    for kinds in KNOWN_DISTRIBUTIONS.values():
        names.update(kinds.get(kind, ()))
    return sorted(names)


def strategy_choices() -> list[str]:
    return [name for name in _known("strategy") if not _NOT_FOR_CLI.search(name)]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fabric run`` (shared by the ``fabric`` parser and ``python -m fabric_core.cli_run``)."""
    parser.add_argument(
        "--accelerator",
        choices=sorted({"auto", "gpu", *_known("accelerator")}),
        default=None,
        help="the hardware to run on (default: what the script's Fabric(...) says, else auto)",
    )
    parser.add_argument(
        "--strategy",
        choices=strategy_choices(),
        default=None,
        help="the strategy (spawn/fork/notebook/xla strategies start their own processes and are not accepted)",
    )
    parser.add_argument(
        "--devices",
        default="1",
        help="devices (processes) per node: a number, or GPU indices such as '0,1' (default: 1)",
    )
    parser.add_argument(
        "--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1, help="number of nodes"
    )
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        help="index of this node (0 = main)",
    )
    parser.add_argument(
        "--main-address",
        "--main_address",
        dest="main_address",
        default="127.0.0.1",
        help="address of node 0, where the processes meet (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--main-port",
        "--main_port",
        dest="main_port",
        type=int,
        default=DEFAULT_MAIN_PORT,
        help=f"a free port on node 0 (default: {DEFAULT_MAIN_PORT})",
    )
    parser.add_argument(
        "--precision",
        choices=_known("precision"),
        default=None,
        help="the precision (default: what the script's Fabric(...) says, else 32-true)",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="treat SCRIPT as a module name and run it like `python -m MODULE`",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, the module) to run")
    parser.add_argument(
        "script_args", metavar="SCRIPT_ARGS", nargs=argparse.REMAINDER, help="arguments passed to the script"
    )


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command to the ``fabric`` parser."""
    parser = subparsers.add_parser(
        "run",
        usage=_USAGE,
        help="run a script on several devices/nodes (Fabric(...) picks the settings up; no launch() needed)",
        description=(
            "Run SCRIPT in --devices processes on this node (and --num-nodes nodes) with torch's elastic launcher."
            " Fabric(...) in the script takes the options given here and joins the process group by itself, so"
            " the script must not call fabric.launch(). Arguments after SCRIPT are passed to it unchanged."
        ),
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=run_main)
    return parser


class CLIError(Exception):
    """A bad combination of options; reported as ``fabric run: error: ...`` with exit status 2."""


def processes_per_node(accelerator: str | None, strategy: str | None, devices: str) -> tuple[int, str]:
    """How many processes to start on this node, and the ``devices`` value the script's Fabric should get."""
    from fabric_core.connector import resolve_accelerator

    name = (accelerator or "auto").lower()
    if name in _TPU_NAMES:
        raise CLIError(
            "Launching processes for TPU through the CLI is not supported: use the xla strategy's launcher."
        )
    try:
        accelerator_obj = resolve_accelerator(_registry(), name)
    except (ValueError, RuntimeError) as err:
        raise CLIError(str(err)) from None
    if accelerator_obj.name in _TPU_NAMES or getattr(accelerator_obj, "device_type", None) == "xla":
        raise CLIError(
            "Launching processes for TPU through the CLI is not supported: use the xla strategy's launcher."
        )
    if strategy == "dp" and accelerator_obj.device_type == "cuda":
        return 1, devices  # one process drives all GPUs (on CPU, dp becomes ddp: one process per device)
    if str(devices).strip().lower() == "auto":
        devices = "1"  # "all devices" is not knowable for every node from here; be explicit
    try:
        count = len(accelerator_obj.parse_devices(devices))
    except (TypeError, ValueError, RuntimeError) as err:
        raise CLIError(str(err)) from None
    return count, devices


def _check_installed(kind: str, name: str | None) -> None:
    if name is None:
        return
    registry = _registry()
    if name.lower() in ("auto", "gpu") and kind == "accelerator":
        return
    if (kind, name) not in registry:
        raise CLIError(registry.unknown_name_message(kind, name))


def torchrun_arguments(args: argparse.Namespace, nprocs: int) -> list[str]:
    """The command line given to torch's elastic launcher (``torch.distributed.run``)."""
    command = [
        f"--nproc-per-node={nprocs}",
        f"--nnodes={args.num_nodes}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={args.main_address}",
        f"--master-port={args.main_port}",
        "--monitor-interval=0.1",  # notice a failed worker within 0.1 s (older torch defaulted to 5 s)
    ]
    if args.module:
        command.append("-m")
    return [*command, args.script, *args.script_args]


def prepare_environment(args: argparse.Namespace, nprocs: int, devices: str) -> dict[str, str]:
    """Set the variables every started process reads; returns what was set."""
    values = {
        CLI_FLAG: "1",
        _CLI_SETTINGS["devices"]: str(devices),
        _CLI_SETTINGS["num_nodes"]: str(args.num_nodes),
    }
    for key in ("accelerator", "strategy", "precision"):
        value = getattr(args, key)
        if value is not None:
            values[_CLI_SETTINGS[key]] = str(value)
    os.environ.update(values)
    # One intra-op thread pool per process sharing the cores; oversubscription makes CPU runs many times slower.
    threads = max(1, (os.cpu_count() or 1) // max(1, nprocs))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    return values


def run_main(args: argparse.Namespace) -> int:
    """Run ``fabric run`` with parsed ``args``; returns the exit status."""
    try:
        if not args.module and not os.path.isfile(args.script):
            raise CLIError(f"SCRIPT {args.script!r} does not exist (use -m to run a module).")
        if args.num_nodes < 1:
            raise CLIError(f"--num-nodes must be a positive integer, got {args.num_nodes}.")
        if not 0 <= args.node_rank < args.num_nodes:
            raise CLIError(f"--node-rank must be between 0 and {args.num_nodes - 1}, got {args.node_rank}.")
        _check_installed("strategy", args.strategy)
        _check_installed("precision", args.precision)
        _check_installed("accelerator", args.accelerator)
        nprocs, devices = processes_per_node(args.accelerator, args.strategy, args.devices)
    except CLIError as err:
        print(f"fabric run: error: {err}", file=sys.stderr)
        return 2
    prepare_environment(args, nprocs, devices)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_arguments(args, nprocs))
    except SignalException as err:  # SIGINT/SIGTERM: the agent has already stopped the workers
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        codes = [failure.exitcode for failure in err.failures.values()]
        code = next((c for c in codes if c > 0), 1)
        return code if code < 256 else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fabric_core.cli_run [OPTIONS] SCRIPT ...``: the ``run`` command on its own."""
    parser = argparse.ArgumentParser(prog="fabric run", usage=_USAGE)
    add_run_arguments(parser)
    return run_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
