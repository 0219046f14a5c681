"""The GPU lane's dry mode (``make gpu-lane DRY=1``) on this machine without CUDA: every step is wired, nothing is
installed, every test marked ``cuda`` is collected and skips (none fails or errors), and the benchmark takes its
no-CUDA exit and its CPU dry run. Plus the static rule the lane's selection rests on: a test skipped for lack of
CUDA is marked ``cuda``, or the lane would never run it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SKIP_FOR_CUDA = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")


def test_every_test_skipped_without_cuda_is_marked_cuda() -> None:
    unmarked = []
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        if not SKIP_FOR_CUDA.search(text):
            continue
        if "pytest.mark.cuda" in text and "pytestmark" in text and re.search(r"pytestmark\s*=\s*\[[^\]]*mark\.cuda", text):
            continue  # the whole module is marked
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if SKIP_FOR_CUDA.search(line) and not line.lstrip().startswith("pytestmark"):
                window = "\n".join(lines[max(0, i - 3) : i + 3])
                if "mark.cuda" not in window:
                    unmarked.append(f"{path.relative_to(REPO)}:{i + 1}")
    assert not unmarked, f"skipped without CUDA but not marked `cuda` (the GPU lane would not run them): {unmarked}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the dry lane on a machine without CUDA")
def test_dry_lane_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "lane.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_lane.py"), "--dry-run", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[gpu-lane] summary" in proc.stdout
    lane = json.loads(out.read_text())
    steps = lane["steps"]
    assert lane["dry_run"] is True
    assert list(steps) == ["probe", "install", "tests", "bench_cpu_dry_run", "bench_single", "bench_parallel"]

    assert steps["probe"]["status"] == "ok" and "available: False" in steps["probe"]["note"]
    # Nothing installed; what a GPU machine would get is listed (the CUDA torch of the pinned version among it).
    install = steps["install"]
    assert install["status"] == "skipped" and "dry run" in install["note"]
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements-dev.txt").read_text(), re.M).group(1)
    assert any(f"torch=={pin}" in cmd for cmd in install["would_run"]), install
    assert not (REPO / ".venv-gpu").exists() or lane["python"] != str(REPO / ".venv-gpu" / "bin" / "python")

    # The CUDA tests: collected from every file that holds one (tests/gpu/ among them), all skipped with a reason.
    tests = steps["tests"]
    assert tests["status"] == "ok", tests
    assert "tests/gpu/test_gpu_paths.py" in tests["files"] and "tests/plugins/amp/test_amp_cuda.py" in tests["files"]
    counts = tests["counts"]
    assert counts["failed"] == counts["errors"] == counts["passed"] == 0, tests
    assert counts["skipped"] >= 12, counts
    assert any("CUDA" in reason for reason in tests["skip_reasons"]), tests["skip_reasons"]

    # The benchmark: its every code path on the CPU with a tiny model, then the no-CUDA exit of the real runs.
    assert steps["bench_cpu_dry_run"]["status"] == "ok", steps["bench_cpu_dry_run"]
    for step in ("bench_single", "bench_parallel"):
        assert steps[step]["status"] == "skipped" and "no CUDA device" in steps[step]["note"], steps[step]
