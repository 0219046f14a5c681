"""Smoke test of the benchmark harness: ``python -m benchmarks --tiny`` runs, and its JSON and Markdown are whole.

No timing is asserted (the numbers of a few iterations mean nothing); the test checks that every section that
should run produced positive measurements under the documented keys, and that skipped sections say why.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _positive(stat: dict) -> bool:
    return stat["n"] >= 1 and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in stat["values"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("bench")
    out, md = tmp / "latest.json", tmp / "benchmarks.md"
    md.write_text("# Hand-written title\n\nkept text\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--tiny",
            "--no-lightning",
            "--out",
            str(out),
            "--md",
            str(md),
            "--ckpt-dir",
            str(tmp),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return json.loads(out.read_text()), md.read_text()


def test_top_level_keys(tiny_run: tuple[dict, str]) -> None:
    results, _ = tiny_run
    assert results["schema"] == 1
    assert results["mode"] == "tiny"
    machine = results["machine"]
    assert machine["cores"] >= 1 and machine["ram_gib"] > 0
    assert machine["torch"] and machine["python"] and machine["fabric_core"]
    assert set(results["sections"]) == {"import", "steps", "checkpoint", "fsdp_checkpoint", "ddp", "fsdp", "deepspeed"}
    assert {t["id"] for t in results["targets"]} >= {
        "import",
        "steps_tiny_dataloader",
        "steps_mlp",
        "save_time",
        "load_mmap",
    }


def test_import_section(tiny_run: tuple[dict, str]) -> None:
    imp = tiny_run[0]["sections"]["import"]
    assert imp["status"] == "ok", imp
    for variant in ("raw", "ours"):
        assert _positive(imp["variants"][variant]["seconds"])
        assert _positive(imp["variants"][variant]["process_seconds"])
    assert _positive(imp["ratios"]["ours"])


def test_steps_section(tiny_run: tuple[dict, str]) -> None:
    steps = tiny_run[0]["sections"]["steps"]
    assert steps["status"] == "ok", steps
    assert set(steps["cases"]) == {"tiny", "tiny_dataloader", "mlp"}
    for case in steps["cases"].values():
        for variant in ("raw", "ours"):
            assert _positive(case["variants"][variant]["steps_per_s"])
        assert _positive(case["ratios"]["ours"])
        assert case["us_added_per_step"]["ours"]["n"] == case["reps"]
        assert set(case["phases_us"]["ours"]) == {"data", "forward", "loss", "backward", "step", "zero_grad"}


def test_checkpoint_section(tiny_run: tuple[dict, str]) -> None:
    ck = tiny_run[0]["sections"]["checkpoint"]
    assert ck["status"] == "ok", ck
    assert ck["state_mib"] > 0
    assert set(ck["save"]) == {"raw", "raw_atomic", "ours", "ours_async_first", "ours_async"}
    assert all(_positive(e["total_seconds"]) for e in ck["save"].values())  # until durable, beside the blocking time
    assert set(ck["load"]) == {"raw", "raw_mmap", "ours", "ours_mmap"}
    for entry in list(ck["save"].values()) + list(ck["load"].values()):
        assert _positive(entry["seconds"])
    assert _positive(ck["load"]["ours_mmap"]["read_seconds"])
    assert _positive(ck["ratios"]["save_time_vs_torch_save"]["ours"])
    assert _positive(ck["ratios"]["mmap_read_vs_torch_load_read"]["ours_mmap"])


def test_skipped_sections_say_why(tiny_run: tuple[dict, str]) -> None:
    for name in ("ddp", "fsdp", "fsdp_checkpoint", "deepspeed"):
        section = tiny_run[0]["sections"][name]
        assert section["status"] == "skipped"
        assert section["reason"]


def test_markdown_report(tiny_run: tuple[dict, str]) -> None:
    results, md = tiny_run
    assert md.startswith("# Hand-written title\n\nkept text\n")  # text outside the markers survives
    assert "<!-- benchmarks:begin" in md and "<!-- benchmarks:end -->" in md
    assert "### Targets" in md
    assert f"{results['machine']['cores']} cores" in md
    assert "### Checkpoints" in md
