"""``python -m benchmarks [--quick | --tiny]``: run the sections, write the JSON results and the Markdown report.

Only a full run of every section, or of some with ``--merge`` (the others kept from the published results),
publishes by default: it replaces ``benchmarks/results/latest.json`` and the generated part of
``docs/benchmarks.md``. A ``--quick`` or ``--tiny`` run, or a full one of some sections without ``--merge``, writes
its JSON to ``benchmarks/results/local/`` (ignored by git) and leaves the published report alone, unless
``--out``/``--md`` say where to write: a quick try never replaces published results.

The sections are the modules of ``benchmarks/sections/`` (see ``benchmarks/section.py``); this file only runs
them in order, each in the current process or, when it asks for it, in a fresh interpreter
(``python -m benchmarks --child NAME CONTEXT_JSON``, which prints its result as one JSON line).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    LIGHTNING,
    OURS,
    RAW,
    REPO_ROOT,
    emit,
    lightning_available,
    machine_info,
    precompile_fabric_packages,
    run_child,
)
from benchmarks.report import evaluate_targets, render_summary, write_markdown
from benchmarks.section import RunContext, Section, by_name, discover

SCHEMA = 2
#: What a full run of every section publishes (tracked in git), and where any other run writes its JSON (ignored).
PUBLISHED_JSON = REPO_ROOT / "benchmarks" / "results" / "latest.json"
PUBLISHED_MD = REPO_ROOT / "docs" / "benchmarks.md"
LOCAL_RESULTS = REPO_ROOT / "benchmarks" / "results" / "local"


def parse_args(argv: list[str] | None, names: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer repetitions, smaller states: a few minutes")
    mode.add_argument(
        "--tiny", action="store_true", help="a few iterations of every section (the harness's smoke test)"
    )
    p.add_argument("--sections", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    p.add_argument(
        "--no-lightning", action="store_true", help="leave lightning-fabric out even when it is installed"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads for the training-loop section (default 1)"
    )
    p.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="clock of the training-loop section"
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"the JSON results (default: {PUBLISHED_JSON.relative_to(REPO_ROOT)} for a full run of every section,"
        f" else {LOCAL_RESULTS.relative_to(REPO_ROOT)}/<mode>.json)",
    )
    p.add_argument(
        "--md",
        default=None,
        help=f"Markdown report to update ('' for none; default: {PUBLISHED_MD.relative_to(REPO_ROOT)} for a full run of"
        " every section, else none)",
    )
    p.add_argument(
        "--ckpt-dir", default=None, help="where checkpoint files are written (default: the system temp dir)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sections' results from --out (same mode) and replace only the ones run now",
    )
    p.add_argument("--child", nargs=2, metavar=("SECTION", "CONTEXT_JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _run_section(section: Section, mode: str, lightning: bool, options: dict[str, Any]) -> dict[str, Any]:
    cfg = section.mode_config(mode)
    if isinstance(cfg, str):
        return {"status": "skipped", "reason": cfg}
    reason = section.unavailable()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    with_lightning = lightning and section.compares_lightning and cfg.get("lightning", True)
    variants = (RAW, OURS, LIGHTNING) if with_lightning else (RAW, OURS)
    ctx = RunContext(mode=mode, config=cfg, variants=variants, options=options, log=_log)
    if not section.isolated:
        return section.run(ctx)
    payload = {"mode": mode, "config": dict(cfg), "variants": list(variants), "options": options}
    return run_child(
        ["-m", "benchmarks", "--child", section.name, json.dumps(payload)],
        timeout=section.timeout_s,
        echo=True,
    )


def _child(name: str, payload: str) -> int:
    """Inside the fresh interpreter of an isolated section: run it, print its result line."""
    data = json.loads(payload)
    ctx = RunContext(
        mode=data["mode"],
        config=data["config"],
        variants=tuple(data["variants"]),
        options=data["options"],
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    emit(by_name(name).run(ctx))
    return 0


def _merge_earlier(results: dict[str, Any], out: Path, names: list[str]) -> None:
    """``--merge``: take the sections this run did not measure from the earlier results at ``out``.

    Only results of the same schema and mode are merged; each kept section keeps its ``measured_at`` (the report
    says when it was measured), and the machine facts are this run's.
    """
    try:
        earlier = json.loads(out.read_text())
    except (OSError, ValueError):
        _log(f"--merge: no earlier results at {out}; writing this run's sections only")
        return
    if earlier.get("schema") != SCHEMA or earlier.get("mode") != results["mode"]:
        _log(f"--merge: {out} holds a different schema or mode ({earlier.get('mode')}); not merged")
        return
    kept = []
    for name, res in earlier.get("sections", {}).items():
        if name in names and name not in results["sections"]:
            res.setdefault("measured_at", earlier.get("created"))
            results["sections"][name] = res
            results["config"][name] = earlier.get("config", {}).get(name)
            kept.append(name)
    results["merged"] = kept
    _log(f"--merge: kept {', '.join(kept) or 'no sections'} from {out}")


def destinations(
    mode: str, wanted: list[str], names: list[str], merge: bool, out: str | None, md: str | None
) -> tuple[Path, str]:
    """Where a run writes its JSON and its Markdown report (``""``: none). A full run of every section publishes
    (``latest.json`` and docs/benchmarks.md), and so does a full run of some with ``--merge`` (the others come from
    the published results); any other run writes to ``benchmarks/results/local/`` and no report, unless told."""
    publishes = mode == "full" and (merge or set(wanted) == set(names))
    json_path = Path(out) if out else PUBLISHED_JSON if publishes else LOCAL_RESULTS / f"{mode}.json"
    if md is None:
        md = str(PUBLISHED_MD) if publishes and json_path == PUBLISHED_JSON else ""
    return json_path, md


def main(argv: list[str] | None = None) -> int:
    sections = discover()
    names = [s.name for s in sections]
    args = parse_args(argv, names)
    if args.child:
        return _child(*args.child)
    mode = "quick" if args.quick else "tiny" if args.tiny else "full"
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(wanted) - set(names)
    if unknown:
        print(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    chosen = [s for s in sections if s.name in wanted]
    lightning = lightning_available() and not args.no_lightning
    options = {"threads": args.threads, "clock": args.clock, "ckpt_dir": args.ckpt_dir}

    started = time.time()
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": mode,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "comparators": {
            RAW: "plain PyTorch",
            OURS: "fabric-core",
            LIGHTNING: "lightning-fabric" if lightning else None,
        },
        "lightning_note": None
        if lightning
        else (
            "lightning-fabric is not installed" if not lightning_available() else "left out (--no-lightning)"
        ),
        "options": {k: v for k, v in options.items() if k != "ckpt_dir"},
        "config": {s.name: s.mode_config(mode) for s in chosen},
        "sections": {},
    }
    _log(
        f"benchmarks ({mode}): {', '.join(results['comparators'][k] or k for k in (RAW, OURS, LIGHTNING) if results['comparators'][k])}; sections {', '.join(s.name for s in chosen)}"
    )
    results["bytecode_precompiled"] = precompile_fabric_packages()
    for section in chosen:
        _log(f"[{section.name}]")
        t0 = time.time()
        try:
            res = _run_section(section, mode, lightning, options)
            res.setdefault("status", "ok")
        except Exception as err:  # one broken section must not hide the others
            res = {"status": "error", "reason": f"{type(err).__name__}: {err}"[-4000:]}
        res["elapsed_s"] = round(time.time() - t0, 1)
        res["measured_at"] = results["created"]
        results["sections"][section.name] = res
        _log(
            f"  -> {res['status']} in {res['elapsed_s']} s"
            + (f": {res['reason']}" if res.get("reason") else "")
        )
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    results["machine"]["loadavg_at_end"] = load
    results["elapsed_s"] = round(time.time() - started, 1)
    out, md = destinations(mode, wanted, names, args.merge, args.out, args.md)
    if args.merge:
        _merge_earlier(results, out, names)
    present = [s for s in sections if s.name in results["sections"]]
    results["targets"] = evaluate_targets(results, present)

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    _log(f"wrote {out}")
    if md:
        write_markdown(Path(md), results, present)
        _log(f"updated {md}")
    elif args.md is None:
        why = f"a {mode} run" if mode != "full" else "not every section"
        _log(f"{PUBLISHED_MD.relative_to(REPO_ROOT)} keeps its published results ({why}); --md PATH writes a report")
    _log(render_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
