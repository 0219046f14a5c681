"""Start-up cost: ``import`` + ``Fabric(accelerator="cpu")`` over a bare ``import torch``, each in a fresh interpreter.

The child times its own statements (that is the headline: what our import adds on top of torch's), in CPU
seconds (``process_time``: on a shared machine, time spent preempted by other processes does not count; importing
is CPU work on files the page cache already holds) and in wall seconds; the harness also times the whole process
(interpreter start and exit included), which is what a user waits for. Whatever plugins are installed in the
environment are discovered as usual, so the number includes their registration cost. With fabric-deepspeed
installed, the child also reports how many ``deepspeed`` modules it imported (the plugin promises none until a
DeepSpeed strategy sets up its processes), and how many ``wandb`` and ``mlflow`` modules (fabric-wandb and
fabric-mlflow promise none until their logger is used).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks._common import (
    LIGHTNING,
    OURS,
    RAW,
    RESULT_PREFIX,
    child_env,
    dist_version,
    paired_ratios,
    parse_result,
    rotated,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

_CHILD = """
import json, sys, time
c0, t0 = time.process_time(), time.perf_counter()
import torch
c1, t1 = time.process_time(), time.perf_counter()
{body}
c2, t2 = time.process_time(), time.perf_counter()
print({prefix!r} + json.dumps({{
    "import_torch_s": t1 - t0,
    "total_s": t2 - t0,
    "import_torch_cpu_s": c1 - c0,
    "total_cpu_s": c2 - c0,
    "modules": len(sys.modules),
    "imports_dynamo": "torch._dynamo" in sys.modules,
    "imports_sympy": "sympy" in sys.modules,
    "deepspeed_modules": sum(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules),
    "tracker_modules": {{t: sum(m == t or m.startswith(t + ".") for m in sys.modules) for t in {trackers!r}}},
}}), flush=True)
"""

#: Experiment trackers whose plugins must not be imported by a `Fabric(...)` that does not use them.
TRACKERS = ("wandb", "mlflow")

BODIES = {
    RAW: "pass",
    OURS: "from fabric_core import Fabric\nFabric(accelerator='cpu')",
    LIGHTNING: "from lightning_fabric import Fabric\nFabric(accelerator='cpu')",
}


def _run_once(variant: str) -> dict[str, Any]:
    code = _CHILD.format(body=BODIES[variant], prefix=RESULT_PREFIX, trackers=TRACKERS)
    env = child_env()
    env.pop("FABRIC_CLI_USED", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"import child for {variant!r} failed:\n{proc.stderr[-2000:]}")
    result = parse_result(proc.stdout)
    result["process_s"] = wall
    return result


def run(ctx: RunContext) -> dict[str, Any]:
    variants, log = list(ctx.variants), ctx.log
    reps = ctx.config["reps"]
    if ctx.config["warmup"]:
        # The page cache then holds every file, so the first measured run is not special.
        for v in variants:
            _run_once(v)
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(reps):
        for v in rotated(variants, rep):
            samples[v].append(_run_once(v))
        log(
            f"  import rep {rep + 1}/{reps}: "
            + ", ".join(
                f"{v} {samples[v][-1]['total_cpu_s']:.2f} s cpu ({samples[v][-1]['total_s']:.2f} s wall)"
                for v in variants
            )
        )

    out: dict[str, Any] = {
        "status": "ok",
        "config": {"reps": reps},
        "clock": "process_cpu",
        # The plugins are discovered in every child; fabric-deepspeed must not make `Fabric(...)` import deepspeed.
        "deepspeed_installed": dist_version("deepspeed"),
        "fabric_deepspeed_installed": dist_version("fabric-deepspeed"),
        "trackers_installed": {
            t: dist_version(f"fabric-{t}") for t in TRACKERS if dist_version(f"fabric-{t}")
        },
        "variants": {},
        "ratios": {},
        "between_process_ratios": {},
        "wall_ratios": {},
        "process_ratios": {},
    }
    raw = samples[RAW]
    for v in variants:
        s = samples[v]
        out["variants"][v] = {
            "statement": BODIES[v],
            "cpu_seconds": summarize([r["total_cpu_s"] for r in s]),
            "seconds": summarize([r["total_s"] for r in s]),
            "import_torch_cpu_seconds": summarize([r["import_torch_cpu_s"] for r in s]),
            "process_seconds": summarize([r["process_s"] for r in s]),
            "modules": s[-1]["modules"],
            "imports_dynamo": s[-1]["imports_dynamo"],
            "imports_sympy": s[-1]["imports_sympy"],
            "deepspeed_modules": max(r["deepspeed_modules"] for r in s),
            "tracker_modules": {t: max(r["tracker_modules"][t] for r in s) for t in TRACKERS},
        }
        if v != RAW:
            # The target's ratio, per child: everything it timed over its own `import torch` (the first statement,
            # the same as the bare child's). The ~1 s torch import varies by +-20 % between interpreters on a shared
            # machine, which drowns the tens of ms we add when one child's total is divided by another's; within one
            # child that noise cancels. The ratio between children is kept as a cross-check.
            out["ratios"][v] = summarize([r["total_cpu_s"] / r["import_torch_cpu_s"] for r in s])
            out["between_process_ratios"][v] = paired_ratios(
                [r["total_cpu_s"] for r in s], [r["total_cpu_s"] for r in raw]
            )
            out["wall_ratios"][v] = paired_ratios([r["total_s"] for r in s], [r["total_s"] for r in raw])
            out["process_ratios"][v] = paired_ratios(
                [r["process_s"] for r in s], [r["process_s"] for r in raw]
            )
            out["variants"][v]["added_cpu_ms"] = summarize(
                [1e3 * (r["total_cpu_s"] - r["import_torch_cpu_s"]) for r in s]
            )
    return out


def render(imp: dict[str, Any], ctx: RenderContext) -> str:
    rows = []
    for v, e in imp["variants"].items():
        rows.append(
            [
                v,
                "`" + e["statement"].replace("\n", "; ") + "`",
                stat(e["cpu_seconds"]),
                stat(e.get("added_cpu_ms"), fixed=0) if v != RAW else "–",
                stat(imp["ratios"].get(v)) if v != RAW else "1",
                stat(imp.get("between_process_ratios", {}).get(v)) if v != RAW else "1",
                stat(e["seconds"]),
                stat(imp["wall_ratios"].get(v)) if v != RAW else "1",
                stat(e["process_seconds"]),
                "yes" if e["imports_dynamo"] else "no",
                str(e["deepspeed_modules"]) if "deepspeed_modules" in e else "–",
                "/".join(str(n) for n in e["tracker_modules"].values()) if "tracker_modules" in e else "–",
            ]
        )
    header = ["variant", "after `import torch`", "CPU s (incl. torch)", "CPU ms added", "CPU ratio"]
    header.append("CPU ratio between processes")
    header += ["wall s", "wall ratio", "whole process wall s", "loads torch._dynamo", "deepspeed modules"]
    header += ["/".join(TRACKERS) + " modules"]
    lines = ["### Import and construction (fresh interpreter per run)", "", *table(header, rows), ""]
    lines.append(
        "`CPU ms added`: the CPU time of the statements after `import torch`, in the same interpreter; `CPU ratio`"
        " (the target's): the child's total CPU time over its own `import torch`, so the variation of torch's import"
        " between interpreters cancels; `CPU ratio between processes`: the child's total over the bare child's of"
        " the same repetition (a cross-check that carries that variation)."
    )
    lines.append("")
    if imp.get("fabric_deepspeed_installed"):
        loaded = imp["variants"].get(OURS, {}).get("deepspeed_modules")
        lines.append(
            f"With fabric-deepspeed {imp['fabric_deepspeed_installed']} and deepspeed"
            f" {imp.get('deepspeed_installed') or 'not installed'} installed (discovered as a plugin in every run):"
            + (
                " `Fabric(accelerator='cpu')` imported no `deepspeed` module."
                if loaded == 0
                else f" `Fabric(accelerator='cpu')` imported {loaded} `deepspeed` module(s)."
            )
        )
    trackers = imp.get("trackers_installed") or {}
    if trackers:
        loaded = imp["variants"].get(OURS, {}).get("tracker_modules", {})
        installed = ", ".join(f"fabric-{t} {v}" for t, v in trackers.items())
        counts = ", ".join(f"{loaded.get(t, '?')} `{t}`" for t in trackers)
        lines.append(f"With {installed} installed: `Fabric(accelerator='cpu')` imported {counts} module(s).")
    return "\n".join(lines)


SECTION = Section(
    name="import",
    order=10,
    modes={
        "full": {"reps": 7, "warmup": True},
        # lightning-fabric's import costs seconds in every fresh interpreter: compared in the full run only.
        "quick": {"reps": 2, "warmup": False, "lightning": False},
        "tiny": {"reps": 1, "warmup": False, "lightning": False},
    },
    run=run,
    render=render,
    targets=(
        Target(
            "import",
            "import + `Fabric(accelerator='cpu')` CPU time / bare `import torch`",
            ("ratios",),
            "<=",
            1.02,
        ),
    ),
)
