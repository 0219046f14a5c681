"""The scaling section's quick mode at world sizes 1 and 2 (the full curve, 1-8, is `python -m benchmarks --quick
--sections scaling`): every strategy and variant reports memory, checkpoint, first-step and steady figures, the
table renders them and the plot is drawn. No timing is asserted; memory and bytes are checked only where they
cannot vary (sharding halves the checkpoint bytes each rank writes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.section import RenderContext, by_name  # noqa: E402


def _positive(s: dict) -> bool:
    return s["n"] == 1 and all(math.isfinite(v) and v > 0 for v in s["values"])


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # 12 fresh jobs; minutes on a loaded 2-core machine
def test_scaling_quick_mode_at_one_and_two_ranks(tmp_path: Path) -> None:
    # multiprocess-check: starts ranks (the scaling section runs 1 and 2 ranks)
    section = by_name("scaling")
    reason = section.unavailable()
    if reason:
        pytest.skip(reason)
    config = {**section.mode_config("quick"), "world_sizes": [1, 2], "plot_path": str(tmp_path / "scaling.png")}
    payload = {"mode": "quick", "config": config, "variants": ["raw", "ours"], "options": {"ckpt_dir": str(tmp_path)}}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--child", "scaling", json.dumps(payload)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON "))
    d = json.loads(line[len("BENCH_JSON ") :])

    assert d["status"] == "ok" and d["failed_jobs"] == [], d.get("failed_jobs")
    assert d["world_sizes"] == [1, 2] and d["model"]["parameters"] > 10_000_000
    for strategy in ("ddp", "fsdp", "model_parallel"):
        for n in ("1", "2"):
            case = d["cases"][strategy][n]
            for variant in ("raw", "ours"):
                e = case[variant]
                for key in ("model_peak_mib", "first_step_s", "steady_steps_per_s", "save_s", "load_s"):
                    assert _positive(e[key]), (strategy, n, variant, key, e[key])
            assert set(case["ratios"]) >= {"model_peak_mib", "first_step_s", "steady_steps_per_s"}
        # Sharded checkpoints: each of 2 ranks writes about half of what 1 rank wrote (same model and optimizer).
        if strategy != "ddp":
            one = d["cases"][strategy]["1"]["ours"]["ckpt_mib_per_rank"]["median"]
            two = d["cases"][strategy]["2"]["ours"]["ckpt_mib_per_rank"]["median"]
            assert 0.4 < two / one < 0.6, (strategy, one, two)
        else:  # rank 0 writes the whole state (fp32 parameters and AdamW's two moments) whatever the world size
            whole = 12 * d["model"]["parameters"] / 2**20
            assert d["cases"]["ddp"]["2"]["ours"]["ckpt_mib_per_rank"]["median"] > 0.95 * whole
    assert set(d["at_largest"]["fsdp"]["growth"]) == {"model_peak_mib_vs_1", "save_s_vs_2", "load_s_vs_2"}
    assert d["loadavg"]["samples"] == 12

    # The plot went where it was asked to, not into docs/; the table names every strategy and world size.
    if d["plot"] is not None:
        assert Path(d["plot"]) == tmp_path / "scaling.png" and (tmp_path / "scaling.png").stat().st_size > 10_000
    md = section.render(d, RenderContext(mode="quick", lightning=False))
    assert md.startswith("### Scaling")
    for strategy in ("ddp", "fsdp", "model_parallel"):
        assert f"| {strategy} | 2 | ours |" in md


def test_the_projection_fits_a_line_over_the_world_sizes_above_one() -> None:
    from benchmarks.sections.scaling import _fit, _projection

    assert _fit([(1, 100.0), (2, 3.0), (4, 5.0), (8, 9.0)]) == (1.0, 1.0)  # N = 1 (no peers) is left out
    assert _fit([(1, 1.0), (2, 1.0)]) is None  # one point above 1 fixes no slope
    assert _fit([(2, 5.0), (4, 3.0), (8, 1.0)])[1] == 0.0  # a falling curve is flat, not negative, at scale
    coll = {str(n): {"ours": {"coll_barrier_ms": {"median": 0.5 + 0.25 * n}}} for n in (1, 2, 4, 8)}
    proj = _projection(coll, [1, 2, 4, 8])["barrier"]
    assert proj["unit"] == "ms" and proj["at"]["1024"] == 0.5 + 0.25 * 1024
