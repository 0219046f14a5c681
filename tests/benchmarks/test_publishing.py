"""Published results are replaced only by the runs meant to publish them, and no documented command leaves the work
tree dirty: a quick or tiny run, or one of some sections, keeps ``benchmarks/results/latest.json`` and
docs/benchmarks.md as they are (a ``--tiny --sections scaling`` try once replaced 186 lines of published results);
``make gpu-lane`` on a machine without a GPU writes its results outside the work tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import LOCAL_RESULTS, PUBLISHED_JSON, PUBLISHED_MD, destinations

REPO = Path(__file__).resolve().parents[2]
NAMES = ["import", "steps", "checkpoint", "scaling"]


@pytest.mark.parametrize(
    ("mode", "wanted", "merge", "out", "md", "expected"),
    [
        ("full", NAMES, False, None, None, (PUBLISHED_JSON, str(PUBLISHED_MD))),  # make bench
        ("full", ["checkpoint"], True, None, None, (PUBLISHED_JSON, str(PUBLISHED_MD))),  # rerun one, keep the rest
        ("full", ["steps", "checkpoint"], False, None, None, (LOCAL_RESULTS / "full.json", "")),
        ("tiny", NAMES, False, None, None, (LOCAL_RESULTS / "tiny.json", "")),
        ("quick", ["scaling"], False, "x.json", None, (Path("x.json"), "")),  # the try: no report
        ("quick", ["scaling"], False, "s.json", "docs/scaling.md", (Path("s.json"), "docs/scaling.md")),  # asked
        ("full", NAMES, False, None, "", (PUBLISHED_JSON, "")),
        ("full", NAMES, False, "elsewhere.json", None, (Path("elsewhere.json"), "")),
    ],
)
def test_only_runs_meant_to_publish_write_the_published_results(mode, wanted, merge, out, md, expected):
    assert destinations(mode, wanted, NAMES, merge, out, md) == expected


def _git_status() -> str | None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def test_a_tiny_run_of_one_section_keeps_the_published_results():
    published = {p: p.read_bytes() for p in (PUBLISHED_JSON, PUBLISHED_MD)}
    status = _git_status()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--no-lightning", "--sections", "import"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p: p.read_bytes() for p in published} == published
    assert "docs/benchmarks.md keeps its published results (a tiny run)" in done.stdout
    local = json.loads((LOCAL_RESULTS / "tiny.json").read_text())
    assert local["mode"] == "tiny" and list(local["sections"]) == ["import"]
    assert _git_status() == status  # benchmarks/results/local/ is ignored


def test_the_gpu_lane_without_a_gpu_leaves_the_work_tree_as_it_was():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: there the lane keeps its results in benchmarks/results/ on purpose")
    results = REPO / "benchmarks" / "results"
    before = sorted(p.name for p in results.iterdir())
    status = _git_status()
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_lane.py"), "--skip", "install,tests,dry_checks,bench_parallel"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wrote = [line.split("wrote ", 1)[1] for line in done.stdout.splitlines() if "wrote " in line]
    assert wrote and not Path(wrote[0]).resolve().is_relative_to(REPO), done.stdout[-2000:]
    assert json.loads(Path(wrote[0]).read_text())["steps"]["bench_single"]["status"] == "skipped"
    assert sorted(p.name for p in results.iterdir()) == before
    assert _git_status() == status
