"""The GPU lane's dry mode (``make gpu-lane DRY=1``) on this machine without CUDA: every CUDA path is listed, every
step is wired, nothing is installed, every listed test is collected and skips (none fails or errors), the dry checks
pass, and the benchmark takes its no-CUDA exit and its CPU dry run. Plus the static rules the lane rests on: a test
skipped for lack of CUDA is marked ``cuda``, every test marked ``cuda`` is a CUDA path of the lane's table (and the
table names no other), and every distribution whose source has a CUDA path is in the table: a new CUDA path cannot be
forgotten."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_lane  # noqa: E402

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


def _cuda_marked_tests() -> set[str]:
    """``path::name`` of every test function marked ``cuda`` (by a decorator or its module's ``pytestmark``)."""
    found = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
            and "mark.cuda" in ast.unparse(node.value)
            for node in tree.body
        )  # fmt: skip
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if module_marked or any("mark.cuda" in ast.unparse(d) for d in node.decorator_list):
                    found.add(f"{path.relative_to(REPO)}::{node.name}")
    return found


def test_every_cuda_test_is_a_cuda_path_of_the_lane_and_the_lane_names_no_other():
    listed = {t for _, _, how in gpu_lane.CUDA_PATHS if not how.startswith(("dry:", "not run:"))
              for t in re.findall(r"tests/[\w/]+\.py::\w+", how)}  # fmt: skip
    marked = _cuda_marked_tests()
    assert marked - listed == set(), f"tests marked `cuda` that benchmarks/gpu_lane.py's CUDA_PATHS does not list: {sorted(marked - listed)}"
    assert listed - marked == set(), f"CUDA_PATHS lists tests that are not marked `cuda` (or do not exist): {sorted(listed - marked)}"
    # the dry checks that are tests exist too
    for test in gpu_lane.cuda_path_tests():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), test


def test_every_distribution_with_a_cuda_path_is_in_the_lanes_table():
    listed = {dist for dist, _, _ in gpu_lane.CUDA_PATHS}
    with_cuda = set()
    for src in [REPO / "core" / "src", *sorted((REPO / "plugins").glob("*/src"))]:
        if any(re.search(r"\bcuda\b", f.read_text(), re.I) for f in src.rglob("*.py")):
            with_cuda.add("fabric-core" if src.parent.name == "core" else f"fabric-{src.parent.name}")
    assert with_cuda - listed == set(), f"distributions with CUDA code that the GPU lane does not list: {sorted(with_cuda - listed)}"
    for dist, what, how in gpu_lane.CUDA_PATHS:  # every entry says how it is covered
        assert how.startswith(("tests/", "dry:", "not run:")) and what, (dist, what, how)


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
    assert list(steps) == ["probe", "install", "tests", "dry_checks", "bench_cpu_dry_run", "bench_single", "bench_parallel"]

    # every CUDA path is listed, in the output and in the summary
    for _dist, what, _ in gpu_lane.CUDA_PATHS:
        assert what in proc.stdout, what
    assert [(p["distribution"], p["path"]) for p in lane["cuda_paths"]] == [(d, w) for d, w, _ in gpu_lane.CUDA_PATHS]

    assert steps["probe"]["status"] == "ok" and "available: False" in steps["probe"]["note"]
    # Nothing installed; what a GPU machine would run is listed: offline (--no-index), our distributions from the
    # working tree, the carried wheels when they are here
    install = steps["install"]
    assert install["status"] == "skipped" and "dry run" in install["note"]
    assert all("--no-index" in cmd for cmd in install["would_run"]), install
    assert any(str(REPO / "plugins" / "bnb") in cmd and str(REPO / "plugins" / "ft") in cmd for cmd in install["would_run"])

    # The listed tests: all collected and skipped with a reason (a CUDA GPU), the dry-check tests of Transformer
    # Engine pass here
    tests = steps["tests"]
    assert tests["status"] == "ok", tests
    assert "tests/gpu/test_gpu_plugins.py::test_ft_ddp_over_nccl_with_a_lighthouse" in tests["selected"]
    counts = tests["counts"]
    assert counts["failed"] == counts["errors"] == 0, tests
    assert counts["skipped"] >= 24 and counts["passed"] >= 3, counts
    assert any("CUDA" in reason for reason in tests["skip_reasons"]), tests["skip_reasons"]
    assert steps["dry_checks"]["status"] == "ok", steps["dry_checks"]

    # The benchmark: its every code path on the CPU with a tiny model, then the no-CUDA exit of the real runs.
    assert steps["bench_cpu_dry_run"]["status"] == "ok", steps["bench_cpu_dry_run"]
    for step in ("bench_single", "bench_parallel"):
        assert steps[step]["status"] == "skipped" and "no CUDA device" in steps[step]["note"], steps[step]
