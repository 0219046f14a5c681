"""``benchmarks/step_instructions.py``: its counted process runs every region in order, and without valgrind the
script says so and exits 0. (The counting itself runs torch's import under valgrind, ~2 min: not in the suite.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_instructions.py"


def test_the_counted_process_runs_every_region_for_both_variants_three_times():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--worker", "--steps", "3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FABRIC_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    order = json.loads(done.stdout.split("ORDER ", 1)[1])
    regions = ("forward", "backward", "step", "zero_grad", "whole step")
    assert order == [[name, label] for _ in range(3) for name in regions for label in ("raw", "ours")]


def test_without_valgrind_it_says_so_and_exits_0(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": str(tmp_path)}
    )
    assert done.returncode == 0 and "valgrind is not installed" in done.stdout, done.stdout + done.stderr
