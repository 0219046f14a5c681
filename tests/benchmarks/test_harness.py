"""The benchmark harness's own logic, with made-up sections: targets, modes, skips, the report's markers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.__main__ import SCHEMA, _merge_earlier, _run_section  # noqa: E402
from benchmarks._common import summarize  # noqa: E402
from benchmarks.report import BEGIN, END, evaluate_target, render_markdown, write_markdown  # noqa: E402
from benchmarks.section import RenderContext, RunContext, Section, Target  # noqa: E402

SPEED = Target("speed", "steps/s / raw", ("ratios",), ">=", 0.98)


def _section(**kwargs: Any) -> Section:
    seen: list[RunContext] = []

    def run(ctx: RunContext) -> dict[str, Any]:
        seen.append(ctx)
        return {
            "ratios": {"ours": summarize([1.0, 0.97, 1.02]), "lightning": summarize([0.8])},
            "n": ctx.config["n"],
        }

    def render(result: dict[str, Any], ctx: RenderContext) -> str:
        return f"### Made up\n\nn = {result['n']}, lightning shown: {ctx.lightning}"

    defaults: dict[str, Any] = {"name": "made_up", "modes": {"full": {"n": 3}}, "run": run, "render": render}
    section = Section(**{**defaults, **kwargs, "targets": kwargs.get("targets", (SPEED,))})
    section.__dict__["seen"] = seen  # frozen dataclass: keep the calls for the assertions
    return section


def _results(section: Section, res: dict[str, Any], mode: str = "full") -> dict[str, Any]:
    machine = {"cpu_model": "cpu", "cores": 2, "usable_cores": 2, "ram_gib": 1.0, "python": "3", "torch": "t"}
    machine |= {"fabric_core": "f", "lightning_fabric": None, "platform": "p", "plugins": []}
    results = {"mode": mode, "created": "now", "elapsed_s": 1.0, "machine": machine, "lightning_note": None}
    results |= {"comparators": {"lightning": None}, "sections": {section.name: res}}
    results["targets"] = [evaluate_target(t, section.name, res, mode) for t in section.targets]
    return results


def test_target_verdicts() -> None:
    ok = {"status": "ok", "ratios": {"ours": summarize([1.0, 0.97, 1.02]), "lightning": summarize([0.8])}}
    met = evaluate_target(SPEED, "s", ok, "full")
    assert met["status"] == "met" and met["range_crosses_target"] is True
    assert met["lightning"]["median"] == 0.8
    strict = Target("speed", "steps/s / raw", ("ratios",), ">=", 1.01)
    assert evaluate_target(strict, "s", ok, "full")["status"] == "not met"
    assert evaluate_target(SPEED, "s", ok, "tiny")["status"].startswith("not judged")
    skipped = evaluate_target(SPEED, "s", {"status": "skipped", "reason": "no plugin"}, "full")
    assert (skipped["status"], skipped["reason"]) == ("skipped", "no plugin")
    assert evaluate_target(SPEED, "s", {"status": "ok", "ratios": {}}, "full")["status"] == "not run"
    assert evaluate_target(SPEED, "s", None, "full")["status"] == "not run"


def test_bad_declarations_fail_at_import() -> None:
    with pytest.raises(ValueError, match="op must be"):
        Target("x", "x", ("r",), "<", 1.0)
    with pytest.raises(ValueError, match="unknown mode"):
        _section(modes={"fast": {}})


def test_a_mode_left_out_or_refused_is_skipped_with_the_reason() -> None:
    section = _section(modes={"full": {"n": 3}, "quick": "too slow for --quick"})
    assert _run_section(section, "quick", False, {}) == {
        "status": "skipped",
        "reason": "too slow for --quick",
    }
    assert _run_section(section, "tiny", False, {}) == {
        "status": "skipped",
        "reason": "not run in --tiny mode",
    }
    unavailable = _section(unavailable=lambda: "`fabric_x` is not importable")
    assert _run_section(unavailable, "full", True, {})["reason"] == "`fabric_x` is not importable"
    assert section.seen == [] and unavailable.seen == []


def test_run_receives_its_mode_settings_and_variants() -> None:
    section = _section(modes={"full": {"n": 3}, "quick": {"n": 1, "lightning": False}})
    assert _run_section(section, "full", True, {"threads": 1})["n"] == 3
    assert _run_section(section, "full", False, {})["n"] == 3
    assert _run_section(section, "quick", True, {})["n"] == 1
    assert [c.variants for c in section.seen] == [
        ("raw", "ours", "lightning"),
        ("raw", "ours"),
        ("raw", "ours"),
    ]
    assert section.seen[0].options == {"threads": 1}
    no_lightning = _section(compares_lightning=False)
    _run_section(no_lightning, "full", True, {})
    assert no_lightning.seen[0].variants == ("raw", "ours")


def test_report_keeps_the_hand_written_text(tmp_path: Path) -> None:
    section = _section()
    res = {"status": "ok", **section.run(RunContext("full", {"n": 3}, ("raw", "ours"), {}))}
    results = _results(section, res)
    md = render_markdown(results, [section])
    assert "### Made up\n\nn = 3, lightning shown: False" in md
    assert "| steps/s / raw | >= 0.98 | 1 [0.97–1.02] | – | met (range crosses) |" in md
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Title\n\nbefore\n\n{BEGIN}\nold numbers\n{END}\n\nafter\n")
    write_markdown(doc, results, [section])
    write_markdown(doc, results, [section])  # a second run replaces the first one's part
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "old numbers" not in text and text.count("### Made up") == 1


def test_a_failing_renderer_loses_only_its_own_part() -> None:
    def broken(result: dict[str, Any], ctx: RenderContext) -> str:
        raise KeyError("missing")

    section = _section(render=broken)
    results = _results(section, {"status": "ok", "ratios": {}, "n": 1})
    md = render_markdown(results, [section])
    assert "### Targets" in md and "rendering failed: KeyError" in md


def test_skipped_sections_say_why() -> None:
    section = _section()
    md = render_markdown(
        _results(section, {"status": "skipped", "reason": "not run in --quick mode"}), [section]
    )
    assert "- `made_up`: skipped: not run in --quick mode" in md


def test_merge_keeps_the_sections_not_run_now(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    earlier = {
        "schema": SCHEMA,
        "mode": "full",
        "created": "monday",
        "config": {"a": {"n": 1}, "b": {"n": 2}},
    }
    earlier["sections"] = {"a": {"status": "ok", "v": "old"}, "b": {"status": "ok", "v": "kept"}, "gone": {}}
    out.write_text(json.dumps(earlier))
    now = {"mode": "full", "created": "tuesday", "config": {"a": {"n": 1}}}
    now["sections"] = {"a": {"status": "ok", "v": "new", "measured_at": "tuesday"}}
    _merge_earlier(now, out, ["a", "b"])  # "gone" is no longer a section: dropped
    assert now["sections"] == {
        "a": {"status": "ok", "v": "new", "measured_at": "tuesday"},
        "b": {"status": "ok", "v": "kept", "measured_at": "monday"},
    }
    assert now["config"]["b"] == {"n": 2} and now["merged"] == ["b"]
    quick = {"mode": "quick", "created": "tuesday", "config": {}, "sections": {}}
    _merge_earlier(quick, out, ["a", "b"])  # another mode's numbers are never mixed in
    assert quick["sections"] == {}


def test_a_kept_section_says_when_it_was_measured() -> None:
    section = _section()
    res = {"status": "ok", "ratios": {}, "n": 1, "measured_at": "monday"}
    assert "(Measured in the run of monday, kept by `--merge`.)" in render_markdown(
        _results(section, res), [section]
    )


def test_a_hung_first_step_job_is_recorded_and_left_out_of_the_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One job of a shared machine that hangs must not lose the other jobs' numbers."""
    import subprocess

    from benchmarks.sections import _data_parallel

    calls: list[list[str]] = []

    def job(strategy: str, variant: str, args: list[str], timeout: float) -> dict[str, Any]:
        calls.append(args)
        if args[1] == "interleaved":
            return {"steps_per_s": {"raw": [10.0, 11.0], "ours": [10.0, 11.0]}, "threads": 1}
        if variant == "ours" and len(calls) == 3:  # the first repetition's `ours` job hangs
            raise subprocess.TimeoutExpired(["torchrun"], timeout)
        first = {"raw": 2.0, "ours": 2.2}[variant]
        return {"first_step_s": first, "imported_s": 1.0, "setup_s": 1.5, "threads": 1}

    monkeypatch.setattr(_data_parallel, "_job", job)
    cfg = {"warmup": 1, "steady_reps": 2, "rounds": 1, "round_steps": 1, "first_step_reps": 3}
    cfg["first_step_variants"] = ["raw", "ours"]
    out = _data_parallel.run("ddp", RunContext("full", cfg, ("raw", "ours"), {}, log=lambda _: None))
    assert len(out["failed_jobs"]) == 1 and out["failed_jobs"][0].startswith(
        "repetition 1, ours: TimeoutExpired"
    )
    assert (
        out["variants"]["raw"]["first_step_s"]["n"] == 3 and out["variants"]["ours"]["first_step_s"]["n"] == 2
    )
    assert out["first_step_ratios"]["ours"]["values"] == pytest.approx([1.1, 1.1])  # only the complete pairs
    assert "- repetition 1, ours: TimeoutExpired" in _data_parallel.render("DDP", out)
