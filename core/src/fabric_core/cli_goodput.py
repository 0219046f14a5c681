"""``fabric goodput RUN_DIR [--png PATH] [--json] [--mtbf SECONDS]``: where the time of a run went.

Reads the goodput ledger's records in a run folder (``fabric.run_info.dir``; by default
``<loggers' root>/runs/<run id>``), prints the split of every rank's time into categories over all attempts, the
attempts (how each ended, what its restart and redone steps cost), the stragglers named, and the checkpoint interval
the measured save cost and failure rate suggest (Young/Daly); ``--png`` draws the split (needs matplotlib). Works on
a run that is still going (its records are at most a few seconds old). Errors print one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_goodput_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``goodput`` sub-command to the ``fabric`` parser."""
    parser = subparsers.add_parser(
        "goodput",
        help="where the time of a run went: start-up, productive steps, checkpoints, waiting, restarts, ...",
        description=(
            "Print the goodput report of a run folder: every rank's wall time over all attempts split into start-up,"
            " productive steps, waiting for slower ranks, checkpoint blocking, restarts, steps redone after a resume,"
            " quorum changes, declared sections and other; the attempts; the stragglers named; a checkpoint interval"
            " from the measured save cost and failure rate (Young/Daly)."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (fabric.run_info.dir)")
    parser.add_argument("--png", default=None, metavar="PATH", help="also draw the split into this PNG (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--mtbf", type=float, default=None, metavar="SECONDS",
        help="mean time between failures to suggest the checkpoint interval with (default: the run's own, if it failed)",
    )  # fmt: skip
    parser.set_defaults(handler=goodput_main)
    return parser


def goodput_main(args: argparse.Namespace) -> int:
    from fabric_core.runtime.goodput_report import GoodputReportError, draw, format_table, summarize

    if args.mtbf is not None and args.mtbf <= 0:
        print(f"error: --mtbf must be a positive number of seconds, got {args.mtbf:g}.", file=sys.stderr)
        return 1
    try:
        summary = summarize(args.run_dir, mtbf_s=args.mtbf)
    except GoodputReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_table(summary), end="" if not args.json else "\n")
    if args.png:
        try:
            draw(summary, args.png)
        except (RuntimeError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"picture: {args.png}")
    return 0
