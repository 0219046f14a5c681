"""``python -m benchmarks [--quick]``: run every section, write the JSON results and the Markdown report."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_deepspeed, bench_distributed, bench_fsdp_checkpoint, bench_import
from benchmarks._common import (
    LIGHTNING,
    OURS,
    RAW,
    REPO_ROOT,
    lightning_available,
    machine_info,
    precompile_fabric_packages,
    run_child,
)
from benchmarks.report import evaluate_targets, render_summary, write_markdown

SECTIONS = ("import", "steps", "checkpoint", "fsdp_checkpoint", "ddp", "fsdp", "deepspeed")

MODES: dict[str, dict[str, Any]] = {
    "full": {
        "import_reps": 7,
        "import_warmup": True,
        "cases": ["tiny", "tiny_dataloader", "mlp"],
        "round_steps": {"tiny": 10, "tiny_dataloader": 10, "mlp": 2},
        "rounds": 40,
        "steps_reps": 7,
        "phases": True,
        "ddp_reps": 5,
        "ddp_warmup": 10,
        "ddp_steady_reps": 7,
        "ddp_rounds": 20,
        "ddp_round_steps": 3,
        "ckpt_mib": 512,
        "ckpt_reps": 11,
        "fsdp_ckpt_mib": 256,
        "fsdp_ckpt_reps": 4,
        "ds_warmup": 10,
        "ds_reps": 9,
        "ds_rounds": 30,
        "ds_round_steps": 3,
    },
    "quick": {
        "import_reps": 2,
        "import_warmup": False,
        "cases": ["tiny", "tiny_dataloader", "mlp"],
        "round_steps": {"tiny": 10, "tiny_dataloader": 10, "mlp": 2},
        "rounds": 10,
        "steps_reps": 3,
        "phases": False,
        "ddp_reps": 1,
        "ddp_warmup": 5,
        "ddp_steady_reps": 2,
        "ddp_rounds": 6,
        "ddp_round_steps": 3,
        "ddp_variants": [RAW, OURS],
        "ds_warmup": 5,
        "ds_reps": 3,
        "ds_rounds": 10,
        "ds_round_steps": 3,
        "skip": {
            "fsdp": "not run in --quick mode (run `python -m benchmarks` for it)",
            "fsdp_checkpoint": "not run in --quick mode (run `python -m benchmarks` for it)",
        },
        # lightning-fabric's import costs seconds in every fresh interpreter: compared in the full run only.
        "no_lightning": ["import", "ddp"],
        "ckpt_mib": 256,
        "ckpt_reps": 1,
    },
    # A few iterations of everything cheap: for the smoke test of the harness itself, numbers mean nothing.
    "tiny": {
        "import_reps": 1,
        "import_warmup": False,
        "cases": ["tiny", "tiny_dataloader", "mlp"],
        "round_steps": {"tiny": 2, "tiny_dataloader": 2, "mlp": 1},
        "rounds": 2,
        "steps_reps": 2,
        "phases": True,
        "ddp_reps": 1,
        "ddp_warmup": 1,
        "ddp_steady_reps": 1,
        "ddp_rounds": 1,
        "ddp_round_steps": 1,
        "skip": {
            "ddp": "not run in --tiny mode (starts 2-process jobs)",
            "deepspeed": "not run in --tiny mode (starts 2-process jobs)",
            "fsdp": "not run in --tiny mode (starts 2-process jobs)",
            "fsdp_checkpoint": "not run in --tiny mode (starts 2-process jobs)",
        },
        "ckpt_mib": 8,
        "ckpt_reps": 1,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="fewer repetitions and a 256 MiB checkpoint: under a minute"
    )
    mode.add_argument(
        "--tiny", action="store_true", help="a few iterations of each cheap section (harness smoke test)"
    )
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    p.add_argument(
        "--no-lightning", action="store_true", help="leave lightning-fabric out even when it is installed"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads for the training-loop section (default 1)"
    )
    p.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="clock of the training-loop section"
    )
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "latest.json"))
    p.add_argument(
        "--md",
        default=str(REPO_ROOT / "docs" / "benchmarks.md"),
        help="Markdown report to update ('' for none)",
    )
    p.add_argument(
        "--ckpt-dir", default=None, help="where checkpoint files are written (default: the system temp dir)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "quick" if args.quick else "tiny" if args.tiny else "full"
    cfg = dict(MODES[mode])
    cfg["threads"] = args.threads
    cfg["clock"] = args.clock
    cfg["ckpt_dir"] = args.ckpt_dir
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        print(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    lightning = lightning_available() and not args.no_lightning
    variants = [RAW, OURS] + ([LIGHTNING] if lightning else [])
    cfg["variants"] = variants

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.time()
    results: dict[str, Any] = {
        "schema": 1,
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
        "config": {k: v for k, v in cfg.items() if k != "ckpt_dir"},
        "sections": {},
    }
    log(f"benchmarks ({mode}): {', '.join(variants)}; sections {', '.join(wanted)}")
    results["bytecode_precompiled"] = precompile_fabric_packages()
    skips: dict[str, str] = cfg.get("skip", {})
    no_lf: list[str] = cfg.get("no_lightning", [])
    for section in SECTIONS:
        if section not in wanted:
            continue
        log(f"[{section}]")
        t0 = time.time()
        try:
            if section in skips:
                res: dict[str, Any] = {"status": "skipped", "reason": skips[section]}
            elif section == "import":
                res = bench_import.run(
                    cfg, [v for v in variants if v != LIGHTNING or section not in no_lf], log
                )
            elif section == "steps":
                res = run_child(["-m", "benchmarks.bench_steps", json.dumps(cfg)], timeout=1800)
            elif section == "checkpoint":
                res = run_child(["-m", "benchmarks.bench_checkpoint", json.dumps(cfg)], timeout=3600)
            elif section == "fsdp_checkpoint":
                res = bench_fsdp_checkpoint.run(cfg)
            elif section in ("ddp", "fsdp"):
                res = bench_distributed.run(section, cfg, lightning and section not in no_lf, log)
            else:  # deepspeed
                res = bench_deepspeed.run(cfg, log)
        except Exception as err:  # one broken section must not hide the others
            res = {"status": "error", "reason": f"{type(err).__name__}: {err}"[-4000:]}
        res["elapsed_s"] = round(time.time() - t0, 1)
        results["sections"][section] = res
        log(
            f"  -> {res['status']} in {res['elapsed_s']} s"
            + (f": {res['reason']}" if res.get("reason") else "")
        )
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    results["machine"]["loadavg_at_end"] = load
    results["elapsed_s"] = round(time.time() - started, 1)
    results["targets"] = evaluate_targets(results)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out}")
    if args.md:
        write_markdown(Path(args.md), results)
        log(f"updated {args.md}")
    log(render_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
