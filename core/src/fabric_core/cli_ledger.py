"""``fabric ledger FOLDER [--json]``: which samples a run lost or trained twice, from its sample ledger.

A run started with ``FABRIC_SAMPLE_LEDGER=FOLDER`` leaves one file per process there (with
``FABRIC_SAMPLE_LEDGER=1``, in its run folder's ``samples/``: FOLDER may name the run folder) (:mod:`fabric_core.runtime.ledger`
describes them and how they are replayed). This prints, per loader and epoch, how many samples were trained, lost and
duplicated (pads counted apart) and where the run resumed; ``--json`` prints the same as JSON. Exit status: 0 when
every sample was trained once, 1 when some were lost or trained twice, 2 when the folder holds no ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_ledger_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``ledger`` sub-command to the ``fabric`` parser."""
    parser = subparsers.add_parser(
        "ledger",
        help="report the samples a run lost or trained twice (from FABRIC_SAMPLE_LEDGER's folder)",
        description=(
            "Replay the sample ledger a run wrote (start it with FABRIC_SAMPLE_LEDGER=FOLDER) and report, per loader"
            " and epoch, the samples trained, lost and trained twice; what was trained after the checkpoint a resume"
            " went back to is not counted. Exit status: 0 all once, 1 lost or duplicated samples, 2 no ledger."
        ),
    )
    parser.add_argument(
        "folder", metavar="FOLDER", help="the folder FABRIC_SAMPLE_LEDGER named, or the run folder (with =1)"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(handler=ledger_main)
    return parser


def ledger_main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fabric_core.runtime.ledger import RUN_SUBFOLDER, report

    folder = Path(args.folder)
    if (folder / RUN_SUBFOLDER).is_dir():  # a run folder (FABRIC_SAMPLE_LEDGER=1 wrote into its samples/)
        folder = folder / RUN_SUBFOLDER
    try:
        result = report(folder)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.text())
    return 0 if result.ok else 1
