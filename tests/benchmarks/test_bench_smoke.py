"""Smoke tests of the benchmark harness: every section runs in ``--tiny`` mode and renders its part of the report.

No timing is asserted (the numbers of a few iterations mean nothing). For each section discovered in
``benchmarks/sections/`` (a new section is picked up without touching this file), ``python -m benchmarks --tiny
--sections NAME`` must finish, its result must have a measurement under every target's path, and its rendered
part must be in the Markdown report, between the markers, with the hand-written text around them kept. The
sections that were here first have their own checks of the keys they document.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.report import BEGIN, END, dig  # noqa: E402
from benchmarks.section import RenderContext, discover  # noqa: E402

SECTIONS = {s.name: s for s in discover()}
#: Sections whose tiny run starts 2-process torch.distributed jobs.
MULTIPROCESS = {"ddp", "fsdp", "model_parallel", "deepspeed", "fsdp_checkpoint", "ray", "ft", "pipeline", "elastic", "goodput", "tiers"}


def _positive(stat: dict) -> bool:
    return stat["n"] >= 1 and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in stat["values"])


def _finite(stat: dict | None) -> bool:
    return (
        bool(stat)
        and stat["n"] >= 1
        and all(isinstance(v, float) and math.isfinite(v) for v in stat["values"])
    )


# ------------------------------------------------------------------------------------------------ per-section checks
def check_import(imp: dict) -> None:
    for variant in ("raw", "ours"):
        assert _positive(imp["variants"][variant]["seconds"])
        assert _positive(imp["variants"][variant]["process_seconds"])
    assert _positive(imp["ratios"]["ours"])


def check_steps(steps: dict) -> None:
    assert set(steps["cases"]) == {"tiny", "tiny_dataloader", "mlp"}
    for case in steps["cases"].values():
        for variant in ("raw", "ours"):
            assert _positive(case["variants"][variant]["steps_per_s"])
        assert _positive(case["ratios"]["ours"])
        assert case["us_added_per_step"]["ours"]["n"] == case["reps"]
        assert set(case["phases_us"]["ours"]) == {"data", "forward", "loss", "backward", "step", "zero_grad"}


def check_checkpoint(ck: dict) -> None:
    assert ck["state_mib"] > 0
    assert set(ck["save"]) == {"raw", "raw_atomic", "ours", "ours_async_first", "ours_async"}
    assert all(
        _positive(e["total_seconds"]) for e in ck["save"].values()
    )  # until durable, beside the blocking time
    assert set(ck["load"]) == {"raw", "raw_mmap", "ours", "ours_mmap"}
    for entry in list(ck["save"].values()) + list(ck["load"].values()):
        assert _positive(entry["seconds"])
    assert _positive(ck["load"]["ours_mmap"]["read_seconds"])
    assert _positive(ck["ratios"]["save_time_vs_torch_save"]["ours"])
    assert _positive(ck["ratios"]["mmap_read_vs_torch_load_read"]["ours_mmap"])
    # The check of what holds on return is made in every run: torch.save's file is always there, and a variant
    # whose file was missing is listed as a failure.
    at_path = ck["checks"]["at_path_on_return"]
    assert at_path["raw"]["median"] == 1.0 and at_path["raw_atomic"]["median"] == 1.0
    assert "ours" in at_path and "ours_async" not in at_path  # asynchronous saves promise it at wait() only
    assert all(s["median"] == 1.0 for s in ck["checks"]["complete_after_wait"].values()), ck["checks"]
    missing = [f for f in ck["failures"] if "not at `path`" in f]
    assert (at_path["ours"]["median"] < 1.0) == any(", ours:" in f for f in missing)


def check_data_parallel(d: dict) -> None:
    for variant in ("raw", "ours"):
        assert _positive(d["variants"][variant]["first_step_s"])
        assert _positive(d["variants"][variant]["steady_steps_per_s"])
    assert d["steady"]["threads_per_process"] >= 1


def check_deepspeed(ds: dict) -> None:
    assert ds["stages"], ds
    for stage in ds["stages"].values():
        assert _positive(stage["variants"]["raw"]["steady_steps_per_s"])
        assert _positive(stage["variants"]["ours"]["steady_steps_per_s"])


def check_fsdp_checkpoint(fc: dict) -> None:
    assert set(fc["variants"]) == {"sync", "async"}
    assert all(_positive(e["blocking_s"]) and _positive(e["total_s"]) for e in fc["variants"].values())


def check_pipeline(p: dict) -> None:
    assert set(p["schedules"]) == {"GPipe", "1F1B", "Interleaved1F1B"}
    for schedule in p["schedules"].values():
        assert _positive(schedule["steps_per_s"]["raw"]) and _positive(schedule["steps_per_s"]["ours"])
        assert _finite(schedule["bubble_measured"]) and 0 < schedule["bubble_theoretical"] < 1
    single, pipeline = (p["memory"][k]["per_rank_max_bytes"] for k in ("single", "pp2"))
    assert 0 < pipeline["parameters"] < single["parameters"]  # each pipeline rank holds part of the model


def check_tiers(t: dict) -> None:
    steps = t["steps"]
    assert set(steps["step_s"]) == {"off", "memory"} and all(_positive(v) for v in steps["step_s"].values())
    assert set(steps["inflight_step_s"]) == {"none", "thread", "process"}
    assert all(_positive(v) for v in steps["save_total_s"].values())
    recovery = t["recovery"]["2"]
    memory, disk = recovery["memory"]["runs"][0], recovery["disk-cold"]["runs"][0]
    kill_at = t["config"]["kill_at"]
    # the restart resumed from the memory snapshot of the kill's step; the wiped node's ranks fetched their peer copies
    assert memory["resumed_from"] == f"mem://step-{kill_at:09d}", memory
    assert any("fetched" in source for source in memory["sources"]), memory["sources"]
    assert disk["resumed_from"].endswith(f"step-{kill_at:09d}.ckpt"), disk
    assert disk["evicted"] and all(e["bytes"] > 0 for e in disk["evicted"])
    for run in (memory, disk):
        assert run["kill_to_step_s"] > 0 and all(v >= 0 for v in run["phases_s"].values()), run
        # the phases chain from the kill to the first step; the reload part is the restoring ones, touch included
        phases = run["phases_s"]
        assert abs(sum(phases.values()) - run["kill_to_step_s"]) < 1e-6, run
        assert abs(sum(phases[k] for k in ("setup", "latest", "load", "touch")) - run["reload_part_s"]) < 1e-6, run


CHECKS: dict[str, Callable[[dict], None]] = {
    "import": check_import,
    "steps": check_steps,
    "checkpoint": check_checkpoint,
    "ddp": check_data_parallel,
    "fsdp": check_data_parallel,
    "deepspeed": check_deepspeed,
    "fsdp_checkpoint": check_fsdp_checkpoint,
    "pipeline": check_pipeline,
    "tiers": check_tiers,
}


def test_the_original_sections_are_discovered() -> None:
    assert set(CHECKS) <= set(SECTIONS)


def test_every_section_runs_in_tiny_mode() -> None:
    """A section without tiny settings would have no smoke test: the harness requires them."""
    for section in SECTIONS.values():
        assert isinstance(section.mode_config("tiny"), dict), section.name
        assert isinstance(section.mode_config("full"), dict), section.name


def test_reading_the_sections_imports_no_torch() -> None:
    """The harness process reads every declaration; torch is imported only where a section measures."""
    code = "import sys; from benchmarks.section import discover; discover(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _run_tiny(name: str, tmp: Path) -> tuple[dict[str, Any], str]:
    out, md = tmp / "latest.json", tmp / "benchmarks.md"
    md.write_text("# Hand-written title\n\nkept text\n")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--no-lightning", "--sections", name]
        + ["--out", str(out), "--md", str(md), "--ckpt-dir", str(tmp)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return json.loads(out.read_text()), md.read_text()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.multiprocess] if n in MULTIPROCESS else [])
        for n in sorted(SECTIONS)
    ],
)
def test_section_tiny_run(name: str, tmp_path: Path) -> None:
    # multiprocess-check: starts ranks (the ddp and fsdp sections run 2 ranks)
    section = SECTIONS[name]
    results, md = _run_tiny(name, tmp_path)

    assert results["schema"] == 2 and results["mode"] == "tiny"
    machine = results["machine"]
    assert machine["cores"] >= 1 and machine["ram_gib"] > 0
    assert machine["torch"] and machine["python"] and machine["fabric_core"]
    assert set(results["sections"]) == {name}
    assert results["config"][name] == section.mode_config("tiny")

    res = results["sections"][name]
    reason = section.unavailable()
    if (
        reason is not None
    ):  # a plugin this section needs is not installed here: it says so, and nothing else runs
        assert res["status"] == "skipped" and res["reason"] == reason
        return
    assert res["status"] == "ok", res
    CHECKS.get(name, lambda _: None)(res)

    # Every target of the section found a measurement, and was not judged on a tiny run.
    targets = [t for t in results["targets"] if t["section"] == name]
    assert [t["id"] for t in targets] == [t.id for t in section.targets]
    for target, declared in zip(targets, section.targets):
        assert _finite(dig(res, declared.path).get(declared.variant)), target
        assert target["status"].startswith("not judged"), target

    # The report: the hand-written text survives, the section's own part sits between the markers.
    assert md.startswith("# Hand-written title\n\nkept text\n")
    generated = md.split(BEGIN, 1)[1].split(END, 1)[0]
    assert "### Targets" in generated and f"{machine['cores']} cores" in generated
    part = section.render(res, RenderContext(mode="tiny", lightning=False)).strip()
    assert part.startswith("### ") and part in generated
