"""``fabric consolidate CHECKPOINT_DIR [--output_file PATH]``: one ``torch.load``-able file from a checkpoint folder
(a local one or one at a URL, such as ``s3://bucket/run/step-100``).

The core knows no sharded format. It asks the registered checkpoint formats (``fabric_register_checkpoint_formats``)
which one recognises the folder (each sharding plugin registers the format its strategies write), reads it whole in
this one process with that format, and writes the result with the core's crash-safe
:func:`~fabric_core.io.commit.atomic_save`. So a new checkpoint format gets ``consolidate`` for free by registering
it, and the CLI has no plugin knowledge.

A CHECKPOINT_DIR that does not exist is a usage error, as the reference's command line has it (click checks its
argument exists): the usage line, ``fabric consolidate: error: ...`` and exit status 2. The other errors (not a
folder, a format no plugin recognises, an existing output) print one line on stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SUFFIX = ".consolidated"


def add_consolidate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``consolidate`` sub-command to the ``fabric`` parser."""
    parser = subparsers.add_parser(
        "consolidate",
        help="convert a checkpoint folder written by a sharding strategy into a single checkpoint file",
        description=(
            "Read a checkpoint folder written by a sharding strategy in this one process"
            " and save it as a single file that `torch.load` and every strategy can read. The"
            " installed plugin that owns the format does the reading. Needs enough memory for the full model"
            " and optimizer state."
        ),
    )
    parser.add_argument("checkpoint_folder", metavar="CHECKPOINT_DIR", help="the checkpoint folder to convert")
    parser.add_argument(
        "--output_file",
        "--output-file",
        dest="output_file",
        default=None,
        help=f"where to write the file (default: CHECKPOINT_DIR{SUFFIX}); must not exist yet",
    )
    parser.set_defaults(handler=consolidate_main, usage=parser.format_usage)
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _usage_error(args: argparse.Namespace, message: str) -> int:
    usage = args.usage() if callable(getattr(args, "usage", None)) else ""
    print(f"{usage}fabric consolidate: error: {message}", file=sys.stderr)
    return 2


def consolidate_main(args: argparse.Namespace) -> int:
    """Convert ``args.checkpoint_folder`` into ``args.output_file``; returns the exit status."""
    from fabric_core.io.location import CheckpointLocation

    location = CheckpointLocation.of(args.checkpoint_folder)  # a local folder or a URL
    folder = str(location)
    if not location.exists():
        return _usage_error(args, f"The provided checkpoint folder does not exist: {folder!r}.")
    if not location.is_dir():
        return _fail(
            f"The provided checkpoint path {folder!r} is a file, not a folder: it is already a single"
            " checkpoint file and needs no consolidation."
        )
    if args.output_file:
        output = CheckpointLocation.of(args.output_file)
    elif location.is_url:
        output = location.sibling(location.name + SUFFIX)
    else:
        output = CheckpointLocation.of(location.path.with_name(location.path.resolve().name + SUFFIX))
    if output.exists():
        return _fail(
            f"The path for the converted checkpoint already exists: {str(output)!r}. Remove it or pass another"
            " `--output_file`."
        )

    from fabric_core.plugins.host import get_registry

    registry = get_registry()
    registered = registry.registered_formats()
    checkpoint_format = next((f for f in (r.recognising(location) for r in registered) if f is not None), None)
    if checkpoint_format is None:
        formats = sorted({registry.get("checkpoint_format", r.name).distribution for r in registered})
        return _fail(
            f"{folder!r} is not a checkpoint folder that an installed plugin can read. The formats installed"
            f" here are read by: {', '.join(formats) or 'no plugin'}. A sharded checkpoint is read by the plugin"
            " of the strategy that wrote it; install it (`fabric plugins` lists what is installed)."
        )

    import torch

    from fabric_core.io.checkpoint_io import TorchCheckpointIO
    from fabric_core.utilities.exceptions import guarded

    checkpoint, err = guarded(checkpoint_format.read, location, map_location=torch.device("cpu"))  # a plugin's code
    if err is not None:
        return _fail(f"Could not read the checkpoint folder {folder!r}: {type(err).__name__}: {err}")
    TorchCheckpointIO().save_checkpoint(checkpoint, output)  # crash-safe locally, one upload at a URL
    print(f"Consolidated {folder!r} into {str(output)!r}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fabric_core.cli_consolidate CHECKPOINT_DIR [--output_file PATH]``."""
    parser = argparse.ArgumentParser(prog="fabric")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_consolidate_parser(subparsers)
    args = parser.parse_args(["consolidate", *(sys.argv[1:] if argv is None else argv)])
    return consolidate_main(args)


if __name__ == "__main__":
    sys.exit(main())
