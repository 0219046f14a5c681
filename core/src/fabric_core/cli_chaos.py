"""``fabric chaos [OPTIONS] -- COMMAND...``: run a training command under a seeded schedule of faults (kill -9 of a
rank or a node's ranks, a hang, a slow rank, SIGSTOP/SIGCONT, a full disk during a save) and check that it
recovered: it finished, its final weights equal an uninterrupted run's, nothing was left behind, and the goodput
ledger accounts for the time. See :mod:`fabric_core.testing.chaos`. Exit status 0 when every check passed, 1 when
one failed, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_chaos_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fabric_core.testing.chaos import FAULT_KINDS

    parser = subparsers.add_parser(
        "chaos",
        help="run a training command under a seeded schedule of faults and check that it recovered exactly",
        description=(
            "Run COMMAND (after --) without faults, then with a seeded schedule of faults that its ranks inject"
            " themselves (FABRIC_CHAOS), and check: it finished; the file --weights names is equal in both runs;"
            " no process or temporary checkpoint file was left; the goodput ledger accounts for the time. The"
            " command recovers on its own (e.g. `fabric run --max-restarts N` and disk checkpoints)."
        ),
    )
    parser.add_argument("--faults", default="kill,hang,slow", help=f"kinds to schedule, comma-separated, repeats allowed ({', '.join(FAULT_KINDS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule (default: 0)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the job, to draw the faults' ranks from (required unless --schedule)")
    parser.add_argument("--processes-per-node", type=int, default=None, help="for node_kill: ranks per node (default: all ranks are one node)")
    parser.add_argument("--steps", default="5-40", help="FIRST-LAST: the steps to place faults at (default: 5-40)")
    parser.add_argument("--slow", default="0.2x20", help="a slow fault's extra seconds per step x steps (default: 0.2x20)")
    parser.add_argument("--stop-seconds", type=float, default=3.0, help="how long a stop fault keeps the rank stopped (default: 3)")
    parser.add_argument("--schedule", default=None, help="a written-out schedule instead: JSON {\"faults\": [...]} or a file holding it")
    parser.add_argument("--hang-timeout", type=float, default=None, help="FABRIC_HANG_TIMEOUT for the chaos run (default: the run's own limits)")
    parser.add_argument("--weights", default=None, help="the file (relative to the run's working folder) whose contents must equal the reference run's")
    parser.add_argument("--out", default="fabric_chaos", help="folder for both runs and their logs (replaced; default: ./fabric_chaos)")
    parser.add_argument("--max-other", type=float, default=0.01, help="largest share of time the ledger may leave as 'other' (default: 0.01)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each run may take (default: 1800)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: the training command")
    parser.set_defaults(handler=chaos_main)
    return parser


def _usage(message: str) -> int:
    print(f"fabric chaos: error: {message}", file=sys.stderr)
    return 2


def chaos_main(args: argparse.Namespace) -> int:
    from fabric_core.runtime.chaos import parse
    from fabric_core.testing.chaos import make_schedule, run_chaos

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _usage("give the training command after --, e.g. `fabric chaos --world-size 2 -- fabric run --devices 2 --max-restarts 3 train.py`.")
    try:
        if args.schedule is not None:
            text = args.schedule
            if not text.lstrip().startswith("{"):
                with open(text) as f:
                    text = f.read()
            faults = parse(text)
        else:
            if args.world_size is None:
                return _usage("--world-size is needed to draw the faults' ranks (or give --schedule).")
            first, _, last = args.steps.partition("-")
            seconds, _, steps = args.slow.partition("x")
            faults = make_schedule(
                [k.strip() for k in args.faults.split(",") if k.strip()],
                seed=args.seed,
                world_size=args.world_size,
                first_step=int(first),
                last_step=int(last or first),
                processes_per_node=args.processes_per_node,
                slow_seconds=float(seconds),
                slow_steps=int(steps or 20),
                stop_seconds=args.stop_seconds,
            )
    except (ValueError, OSError) as err:
        return _usage(str(err))
    report = run_chaos(
        command,
        faults,
        out=args.out,
        weights=args.weights,
        hang_timeout=args.hang_timeout,
        max_other=args.max_other,
        timeout=args.timeout,
    )
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.text(), end="" if not args.json else "\n")
    return 0 if report.ok else 1
