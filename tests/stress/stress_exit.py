"""Repeat short successful 2-process jobs and count non-zero exits (a successful run must exit 0 every time).

    python tests/stress/stress_exit.py [--runs 200] [--modes script,function,spawn] [--load 1]

``--load N`` keeps N busy-looping processes running beside the jobs (a loaded machine makes teardown races
visible). Prints one line per failure (mode, exit code, last lines of output) and a summary; exits 1 if any
run failed. ``make stress`` runs it with the defaults.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from jobs import job_env  # noqa: E402


def _burn() -> None:
    while True:
        pass


def run_once(mode: str, timeout: float) -> tuple[int, str]:
    env = job_env(PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / "short_job.py"), mode],
            capture_output=True, text=True, env=env, timeout=timeout, start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        return -1, f"timeout after {timeout} s: {err.stdout or ''}{err.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200, help="runs per mode")
    parser.add_argument("--modes", default="script,function,spawn")
    parser.add_argument("--load", type=int, default=1, help="busy processes running beside the jobs")
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args(argv)
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    codes: dict[str, Counter] = {}
    started = time.monotonic()
    try:
        for i in range(args.runs):
            for mode in args.modes.split(","):
                code, output = run_once(mode, args.timeout)
                codes.setdefault(mode, Counter())[code] += 1
                if code != 0:
                    tail = "\n    ".join(output.strip().splitlines()[-6:])
                    print(f"run {i} {mode}: exit {code}\n    {tail}", flush=True)
    finally:
        for b in burners:
            b.terminate()
    failed = sum(n for c in codes.values() for code, n in c.items() if code != 0)
    for mode, counter in codes.items():
        print(f"{mode}: {sum(counter.values())} runs, exit codes {dict(counter)}")
    print(f"{failed} non-zero exits in {sum(sum(c.values()) for c in codes.values())} runs, {time.monotonic() - started:.0f} s"
          f" (load {args.load}, {os.cpu_count()} cores)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
