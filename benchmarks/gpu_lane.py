"""The GPU lane: every CUDA path of every plugin, in one command on a lent GPU machine (``make gpu-lane``, <= 8 min).

    python benchmarks/gpu_wheels.py           # here, with the registry: the wheels the lane installs -> .gpu-wheels/
    python benchmarks/gpu_lane.py             # there (no network): carry .gpu-wheels with the working tree
    python benchmarks/gpu_lane.py --dry-run   # anywhere: lists every CUDA path, checks the wiring, installs nothing

The lent machine (the device tool's README) has its own Python 3.12 with a CUDA build of torch, pytest and the usual
scientific packages, no network, and takes at most 64 MiB of working tree (``carry`` included). So the lane installs
offline: the third-party wheels that ``benchmarks/gpu_wheels.py`` fetched here into ``.gpu-wheels/`` (bitsandbytes
with only the CPU library and that CUDA release's, torchao, torchft and OpenTelemetry, DeepSpeed and hjson/pydantic,
setuptools; 15 MiB) and our own distributions built from the working tree, all into one target folder put first on
``PYTHONPATH``. The device call: ``run(command="python3 benchmarks/gpu_lane.py", carry=[".gpu-wheels"], timeout_s=600)``
(``make gpu-lane`` does the same where make is installed).

Steps, each with its own timeout (and all within ``--budget`` seconds):

1. ``probe``: the interpreter whose torch sees a GPU, its torch and CUDA, the GPUs (``nvidia-smi``).
2. ``install``: the carried wheels, then fabric-core and the plugins with a CUDA path (no dependencies, no build
   isolation), into ``--site``; then every plugin and its library is imported, and a failure fails the step.
3. ``tests``: every test of :data:`CUDA_PATHS` (all tests marked ``cuda``: ``tests/benchmarks/test_gpu_lane.py``
   checks the table against them) plus the dry checks that are tests. A test skipped for anything but missing
   hardware (a second GPU, float8 matmuls) fails the step: here a missing package is a failure, not a skip.
4. ``dry_checks``: what the lane does not run for real, saying so: the Ray launcher's GPU bundles (the bundle and
   actor resources of ``--accelerator cuda``, no Ray cluster: Ray is not carried) and Transformer Engine (not
   carried: ``fabric plugins --check`` must name what is missing and how to install it).
5. ``bench_single``, ``bench_parallel``: ``benchmarks/gpu_bench.py`` (tokens/s and MFU, raw loop vs ours), cut to
   what is left of the budget.

Results go to ``benchmarks/results/``: ``gpu_lane_latest.json`` (this summary: every CUDA path with its outcome),
``gpu_latest.json`` and ``gpu_parallel_latest.json``; where torch sees no GPU they go to a temporary folder (the
summary says which), so the lane never leaves the work tree dirty on a machine without one. ``--dry-run`` installs nothing, prints the CUDA paths and the
install plan, runs the tests here (they must all skip, none fail), the dry checks and the benchmark's no-CUDA path,
and writes its summary to ``--out`` only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
WHEELS = REPO / ".gpu-wheels"
DEFAULT_SITE = Path(tempfile.gettempdir()) / "fabric-gpu-site"
#: Our distributions with a CUDA path (fabric-ray for its dry check: importing its launcher needs no Ray).
GPU_DISTS = ("core", "plugins/ddp", "plugins/amp", "plugins/fsdp", "plugins/deepspeed", "plugins/bnb", "plugins/ao",
             "plugins/ft", "plugins/ray")  # fmt: skip
#: Modules the lane must be able to import after the install (package -> what brings it).
IMPORTS = {
    "fabric_core": "core", "fabric_ddp": "plugins/ddp", "fabric_amp": "plugins/amp", "fabric_fsdp": "plugins/fsdp",
    "fabric_deepspeed": "plugins/deepspeed", "fabric_bnb": "plugins/bnb", "fabric_ao": "plugins/ao",
    "fabric_ft": "plugins/ft", "fabric_ray": "plugins/ray", "bitsandbytes": ".gpu-wheels", "torchao": ".gpu-wheels",
    "torchft": ".gpu-wheels", "deepspeed": ".gpu-wheels", "pytest": "the image", "pytest_timeout": "the image",
}  # fmt: skip
#: Seconds per step; each is also cut to what is left of ``--budget``.
TIMEOUTS = {"probe": 60, "install": 150, "tests": 300, "dry_checks": 60, "bench_single": 120, "bench_parallel": 120}

#: Every CUDA path of every distribution: (distribution, what, how it is checked). ``how`` is a test (all its
#: parameters), ``dry: ...`` (checked without running it for real, and why), or ``not run: ...`` (why not).
#: tests/benchmarks/test_gpu_lane.py checks that the tests here are exactly the tests marked ``cuda`` and that every
#: distribution whose source has a CUDA path is listed: a new CUDA path cannot be forgotten.
CUDA_PATHS: tuple[tuple[str, str, str], ...] = (
    ("fabric-core", "bf16-true: the model in bfloat16 on the GPU, init_module on the device",
     "tests/gpu/test_gpu_paths.py::test_bf16_true_puts_the_model_in_bfloat16_on_the_device"),
    ("fabric-core", "asynchronous save snapshots GPU tensors",
     "tests/gpu/test_gpu_paths.py::test_async_save_snapshots_gpu_tensors_before_training_changes_them"),
    ("fabric-core", "MFU from the device's peak FLOP/s",
     "tests/gpu/test_gpu_paths.py::test_throughput_monitor_reports_mfu_on_the_gpu"),
    ("fabric-core", "the device's peak FLOP/s table", "tests/core/test_throughput.py::test_cuda_device_peak"),
    ("fabric-ddp", "DDP over NCCL (2 GPUs: 2 ranks)", "tests/gpu/test_gpu_paths.py::test_ddp_over_nccl_keeps_the_ranks_equal"),
    ("fabric-ddp", "dp on CUDA", "tests/plugins/ddp/test_ddp_plugin.py::test_dp_on_cuda_is_one_process"),
    ("fabric-amp", "bf16-mixed: CUDA autocast", "tests/gpu/test_gpu_paths.py::test_bf16_mixed_runs_the_forward_under_cuda_autocast"),
    ("fabric-amp", "16-mixed: a CUDA GradScaler", "tests/plugins/amp/test_amp_cuda.py::test_16_mixed_on_cuda_scales_with_a_cuda_grad_scaler"),
    ("fabric-amp", "16-mixed skips non-finite steps", "tests/plugins/amp/test_amp_cuda.py::test_16_mixed_on_cuda_skips_non_finite_steps"),
    ("fabric-amp", "bf16-mixed has no scaler", "tests/plugins/amp/test_amp_cuda.py::test_bf16_mixed_on_cuda_has_no_scaler"),
    ("fabric-fsdp", "FSDP2 over NCCL, bf16-mixed, sharded checkpoint from GPU tensors",
     "tests/gpu/test_gpu_paths.py::test_fsdp_over_nccl_trains_and_round_trips_a_sharded_checkpoint"),
    ("fabric-fsdp", "the seed skeleton on 2 GPUs", "tests/plugins/fsdp/test_fsdp.py::test_seed_skeleton_on_two_gpus"),
    ("fabric-deepspeed", "ZeRO-2 over NCCL, bf16", "tests/gpu/test_gpu_paths.py::test_deepspeed_zero2_on_gpu_trains_and_round_trips"),
    ("fabric-bnb", "nf4, nf4-dq, fp4, fp4-dq, int8, int8-training on CUDA against bitsandbytes' own layers",
     "tests/gpu/test_gpu_plugins.py::test_bitsandbytes_mode_on_cuda_equals_bitsandbytes_own_layers"),
    ("fabric-bnb", "8-bit optimizers (AdamW8bit, PagedAdamW8bit paged) on CUDA",
     "tests/gpu/test_gpu_plugins.py::test_bitsandbytes_8bit_optimizers_on_cuda_train_like_the_plain_loop"),
    ("fabric-ao", "real float8 matmuls (tensorwise, rowwise) against torchao's own conversion",
     "tests/gpu/test_gpu_plugins.py::test_float8_runs_real_float8_matmuls_and_trains_like_torchao"),
    ("fabric-ao", "Transformer Engine precisions",
     "dry: not carried (it builds against the CUDA toolkit); `fabric plugins --check` and Fabric(precision=...) must name"
     " what is missing: tests/plugins/ao/test_float8.py::test_transformer_engine_says_what_is_missing,"
     " tests/plugins/ao/test_float8.py::test_plugins_check_says_what_transformer_engine_and_float8_lack"),
    ("fabric-ft", "ft_ddp: ProcessGroupNCCL between replica groups, a real lighthouse",
     "tests/gpu/test_gpu_plugins.py::test_ft_ddp_over_nccl_with_a_lighthouse"),
    ("fabric-ray", "the launcher's GPU bundles (`--accelerator cuda`)",
     "dry: the placement bundle and each actor's resources are computed and checked; no Ray cluster is started (Ray is"
     " not carried: its wheel alone is ~70 MB)"),
    ("fabric-xla", "XLA on CUDA (PJRT_DEVICE=CUDA)",
     "not run: torch_xla needs its own torch (the XLA lane runs the CPU PJRT device); no CUDA build is carried"),
)  # fmt: skip
#: Skip reasons that mean missing hardware, which the lane accepts (anything else skipped fails the tests step).
HARDWARE_SKIPS = re.compile(r"CUDA GPU|2 CUDA GPUs|compute capability|bfloat16 support|peak FLOP/s|on a machine without CUDA")

PROBE = r"""
import json, sys
out = {"python": sys.executable, "version": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if out["cuda_available"] else []
    out["capability"] = list(torch.cuda.get_device_capability()) if out["cuda_available"] else None
except Exception as err:
    out.update(torch=None, error=f"{type(err).__name__}: {err}")
import importlib.util as u
out["xdist"] = u.find_spec("xdist") is not None
print(json.dumps(out))
"""

IMPORT_CHECK = r"""
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        found[name] = {"ok": True, "version": getattr(module, "__version__", None), "file": getattr(module, "__file__", None)}
    except Exception as err:
        found[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
if found.get("bitsandbytes", {}).get("ok"):
    import bitsandbytes, torch
    lib = getattr(getattr(bitsandbytes, "cextension", None), "lib", None)
    found["bitsandbytes"]["library"] = str(getattr(lib, "_name", lib))
print(json.dumps(found))
"""

DRY_RAY = r"""
import importlib.util, json
from fabric_ray.launcher import actor_resources, node_bundle
checks = {
    "bundle_per_node_gpu": node_bundle(2, True) == {"GPU": 2.0, "CPU": 2.0},
    "bundle_per_node_cpu": node_bundle(2, False) == {"CPU": 2.0},
    "actor_takes_one_gpu": actor_resources(True) == {"num_cpus": 0, "num_gpus": 1},
    "actor_takes_one_cpu": actor_resources(False) == {"num_cpus": 1, "num_gpus": 0},
}
print(json.dumps({"checks": checks, "ray_installed": importlib.util.find_spec("ray") is not None}))
"""

DRY_TE = r"""
import json
from fabric_core.cli import collect_plugins
from fabric_core.plugins import get_registry
rows = collect_plugins(get_registry(), check=True, kinds=["precision"])["entries"]
print(json.dumps({e["name"]: {"status": e["status"], "reason": e["reason"]} for e in rows if e["name"].startswith("transformer-engine")}))
"""


def cuda_path_tests() -> list[str]:
    """The node ids of the tests in :data:`CUDA_PATHS` (each with all its parameters) and of the dry-check tests."""
    ids = []
    for _, _, how in CUDA_PATHS:
        ids += re.findall(r"tests/[\w/]+\.py::\w+", how)
    return list(dict.fromkeys(ids))


class Lane:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.site = Path(args.site)
        self.deadline = time.monotonic() + args.budget
        self.steps: dict[str, dict[str, Any]] = {}
        self.env: dict[str, str] = {}
        self.python = sys.executable
        self.python_info: dict[str, Any] = {}

    # -------------------------------------------------------------------------------------------- helpers
    def timeout(self, step: str) -> float:
        return max(1.0, min(TIMEOUTS[step], self.deadline - time.monotonic()))

    def run(self, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """One command with a hard timeout; never raises: returns its code (None on timeout) and output tail."""
        t0 = time.monotonic()
        try:
            # its own session, so that a timeout ends the whole tree (torchrun's workers hold the GPU otherwise)
            proc = subprocess.Popen(
                [str(c) for c in cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, **self.env, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        except OSError as err:
            return {"cmd": " ".join(str(c) for c in cmd), "code": 127, "seconds": 0.0, "tail": f"{type(err).__name__}: {err}"}
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            code, out = None, f"{out or ''}\n[timed out after {timeout:.0f} s: its process group was killed]"
        return {"cmd": " ".join(str(c) for c in cmd)[:600], "code": code, "seconds": round(time.monotonic() - t0, 1),
                "tail": out[-2500:]}  # fmt: skip

    def record(self, step: str, status: str, **info: Any) -> dict[str, Any]:
        self.steps[step] = {"status": status, **info}
        line = f"[gpu-lane] {step}: {status}"
        if info.get("note"):
            line += f" ({info['note']})"
        print(line, flush=True)
        return self.steps[step]

    def json_of(self, cmd: list[str], timeout: float) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        res = self.run(cmd, timeout)
        try:
            return (json.loads(res["tail"].strip().splitlines()[-1]) if res["code"] == 0 else None), res
        except (ValueError, IndexError):
            return None, res

    # -------------------------------------------------------------------------------------------- steps
    def probe(self) -> None:
        candidates = [self.args.python] if self.args.python else []
        # this interpreter (the lent machine's python3 under `make gpu-lane`), then make setup's venv (a dry run here)
        candidates += [sys.executable, shutil.which("python3") or "", str(REPO / ".venv" / "bin" / "python")]
        found, seen = [], set()
        for python in candidates:
            if not python or python in seen or not Path(python).exists():
                continue
            seen.add(python)
            info, _ = self.json_of([python, "-c", PROBE], self.timeout("probe"))
            if info is not None:
                found.append(info)
        smi = shutil.which("nvidia-smi")
        gpus = (
            self.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 30)
            if smi
            else {"code": None, "tail": "nvidia-smi not found"}
        )
        with_cuda = [f for f in found if f.get("cuda_available")]
        with_torch = [f for f in found if f.get("torch")]
        self.python_info = (with_cuda or with_torch or [{"python": sys.executable, "torch": None}])[0]
        self.python = self.python_info["python"]
        note = (
            f"{self.python}: torch {self.python_info.get('torch')} (CUDA {self.python_info.get('torch_cuda')},"
            f" available: {self.python_info.get('cuda_available')}); GPUs: "
            + (gpus["tail"].strip().replace("\n", "; ") if gpus.get("code") == 0 else "none visible")
        )
        self.record("probe", "ok", note=note, interpreters=found, nvidia_smi=gpus["tail"].strip())

    def install(self) -> None:
        wheels = sorted(WHEELS.glob("*.whl"))
        manifest = json.loads((WHEELS / "MANIFEST.json").read_text()) if (WHEELS / "MANIFEST.json").exists() else {}
        site = str(self.site)
        pip = [self.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--upgrade", "--target", site]  # fmt: skip
        planned = []
        if wheels:
            planned.append([*pip, *[str(w) for w in wheels]])
        planned.append([*pip, "--no-build-isolation", *[str(REPO / d) for d in GPU_DISTS]])
        torch_cuda = (self.python_info.get("torch_cuda") or "").replace(".", "")
        notes = []
        if not wheels:
            notes.append(f"no wheels in {WHEELS}: run `python benchmarks/gpu_wheels.py` here and carry .gpu-wheels")
        elif manifest.get("cuda") and torch_cuda and manifest["cuda"] != torch_cuda:
            notes.append(f"the carried bitsandbytes library is for CUDA {manifest['cuda']}, torch has {torch_cuda}:"
                         f" run `python benchmarks/gpu_wheels.py --cuda {torch_cuda}`")  # fmt: skip
        if self.dry:
            self.record("install", "skipped", note="dry run: nothing installed; " + ("; ".join(notes) or
                        f"{len(wheels)} wheels ready ({sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB)"),
                        would_run=[" ".join(c) for c in planned], wheels=[w.name for w in wheels])  # fmt: skip
            return
        self.site.mkdir(parents=True, exist_ok=True)
        # the carried setuptools builds our distributions (no build isolation: nothing to download)
        self.env = {"PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])),
                    "PATH": os.pathsep.join([str(self.site / "bin"), os.environ.get("PATH", "")]),
                    "PIP_NO_INDEX": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
        ran = [self.run(cmd, self.timeout("install")) for cmd in planned]
        found, res = self.json_of([self.python, "-c", IMPORT_CHECK, *IMPORTS], self.timeout("install"))
        broken = {m: (found or {}).get(m, {}).get("error", res["tail"][-300:]) for m in IMPORTS if not (found or {}).get(m, {}).get("ok")}
        failed = [r for r in ran if r["code"] != 0]
        status = "ok" if not failed and not broken else "failed"
        note = f"{len(wheels)} wheels and {len(GPU_DISTS)} distributions into {site}"
        if broken:
            note += "; cannot import: " + ", ".join(f"{m} (from {IMPORTS[m]})" for m in broken)
        note += "".join(f"; {n}" for n in notes)
        self.record("install", status, note=note, ran=ran, imports=found, broken=broken)

    def tests(self) -> None:
        ids = cuda_path_tests()
        xml = Path(tempfile.mkdtemp()) / "cuda.xml"
        parallel = ["-n", "4", "--dist", "loadfile"] if self.python_info.get("xdist") else []
        cmd = [self.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *parallel, *ids]
        res = self.run(cmd, self.timeout("tests"))
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        outcomes: dict[str, list[str]] = {}
        failed_ids: list[str] = []
        skip_reasons: set[str] = set()
        bad_skips: list[str] = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                key = f"{(case.get('classname') or '').replace('.', '/')}.py::{(case.get('name') or '').split('[')[0]}"
                if case.find("failure") is not None or case.find("error") is not None:
                    outcome = "failed"
                    counts["failed" if case.find("failure") is not None else "errors"] += 1
                    failed_ids.append(name)
                elif (skip := case.find("skipped")) is not None:
                    outcome = "skipped"
                    counts["skipped"] += 1
                    reason = (skip.get("message") or "").strip()[:200]
                    skip_reasons.add(reason)
                    if not HARDWARE_SKIPS.search(reason):
                        bad_skips.append(f"{name}: {reason}")
                else:
                    outcome = "passed"
                    counts["passed"] += 1
                outcomes.setdefault(key, []).append(outcome)
        self.outcomes = outcomes
        # pytest exits 0 when everything passed or skipped; a skip for a missing package fails the lane
        ok = res["code"] == 0 and not counts["failed"] and not counts["errors"] and not (bad_skips and not self.dry)
        note = ", ".join(f"{n} {k}" for k, n in counts.items())
        if bad_skips and not self.dry:
            note += f"; {len(bad_skips)} skipped for something other than missing hardware"
        self.record("tests", "ok" if ok else "failed", note=note, selected=ids, counts=counts, failed=failed_ids,
                    skip_reasons=sorted(skip_reasons), bad_skips=bad_skips, run=res)  # fmt: skip

    def dry_checks(self) -> None:
        ray, ray_run = self.json_of([self.python, "-c", DRY_RAY], self.timeout("dry_checks"))
        te, te_run = self.json_of([self.python, "-c", DRY_TE], self.timeout("dry_checks"))
        checks = {}
        checks["ray_gpu_bundles"] = {
            "status": "ok" if ray and all(ray["checks"].values()) else "failed",
            "note": "dry check only: bundle and actor resources of --accelerator cuda computed; no Ray cluster started",
            "result": ray, "run": None if ray else ray_run,
        }  # fmt: skip
        te_ok = bool(te) and all(
            (e["status"] == "available") or ("pip install" in (e["reason"] or "") or "CUDA GPU" in (e["reason"] or ""))
            for e in te.values()
        )
        checks["transformer_engine"] = {
            "status": "ok" if te_ok and len(te) == 2 else "failed",
            "note": "dry check only: not carried; `fabric plugins --check` names what is missing and how to install it",
            "result": te, "run": None if te else te_run,
        }  # fmt: skip
        status = "ok" if all(c["status"] == "ok" for c in checks.values()) else "failed"
        self.record("dry_checks", status, note="; ".join(f"{k}: {c['status']}" for k, c in checks.items()), checks=checks)

    @property
    def keeps_results(self) -> bool:
        """Whether results go to ``benchmarks/results/``: a real run on a GPU. A dry run, or a machine whose torch
        sees no GPU, measures nothing worth keeping and leaves the work tree as it was (a temporary folder)."""
        return not self.dry and bool(self.python_info.get("cuda_available"))

    def bench(self, step: str, extra: list[str], out_name: str) -> None:
        out = RESULTS / out_name if self.keeps_results else Path(tempfile.mkdtemp()) / out_name
        cmd = [self.python, str(REPO / "benchmarks" / "gpu_bench.py"), "--out", str(out), *extra]
        res = self.run(cmd, self.timeout(step))
        if self.dry and step == "bench_single":  # and every code path of the script on the CPU (tiny model)
            dry = Path(tempfile.mkdtemp()) / "cpu_dry.json"
            cpu = self.run([self.python, str(REPO / "benchmarks" / "gpu_bench.py"), "--cpu-dry-run", "--sections",
                            "single", "--reps", "1", "--steps", "2", "--out", str(dry)], self.timeout(step))  # fmt: skip
            status = json.loads(dry.read_text())["sections"]["single"]["status"] if dry.exists() else None
            self.steps["bench_cpu_dry_run"] = {"status": "ok" if cpu["code"] == 0 and status == "ok" else "failed",
                                               "note": f"section status {status}", "run": cpu}  # fmt: skip
            print(f"[gpu-lane] bench_cpu_dry_run: {self.steps['bench_cpu_dry_run']['status']}", flush=True)
        if res["code"] != 0:
            self.record(step, "failed", note=f"exit code {res['code']}", run=res)
            return
        if "no CUDA device is available" in res["tail"]:
            self.record(step, "skipped", note="no CUDA device: gpu_bench.py said so and exited 0", run=res)
            return
        data = json.loads(out.read_text()) if out.exists() else {}
        lines = [ln for ln in res["tail"].splitlines() if ln.startswith("[")]
        self.record(step, "ok", note="; ".join(lines) or "no section line", results=str(out), sections=data.get("sections"),
                    run=res)  # fmt: skip

    def paths(self) -> list[dict[str, Any]]:
        """Every CUDA path with what happened to it in this run: its tests' outcomes, and its dry check's status."""
        outcomes = getattr(self, "outcomes", {})
        dry_checks = self.steps.get("dry_checks", {}).get("checks", {})
        dry_of = {"fabric-ray": "ray_gpu_bundles", "fabric-ao": "transformer_engine"}
        rows = []
        for dist, what, how in CUDA_PATHS:
            row = {"distribution": dist, "path": what, "how": how,
                   "outcomes": [o for t in re.findall(r"tests/[\w/]+\.py::\w+", how) for o in outcomes.get(t, [])]}  # fmt: skip
            if how.startswith("dry:"):
                row["dry_check"] = dry_checks.get(dry_of.get(dist, ""), {}).get("status")
            rows.append(row)
        return rows


def list_paths() -> str:
    lines = ["CUDA paths of every distribution (what the lane runs, and what it checks only dry):"]
    for dist, what, how in CUDA_PATHS:
        lines.append(f"  {dist:17s} {what}\n  {'':17s}   -> {how}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list the CUDA paths, check the wiring here, install nothing")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole lane (default 480: 8 minutes)")
    p.add_argument("--python", default=None, help="interpreter to test with (default: the first whose torch has CUDA)")
    p.add_argument("--site", default=str(DEFAULT_SITE), help="where the lane installs (put first on PYTHONPATH)")
    p.add_argument("--out", default=None, help="the summary JSON (default benchmarks/results/gpu_lane_latest.json)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out (e.g. bench_parallel)")
    args = p.parse_args(argv)
    print(list_paths(), flush=True)
    lane = Lane(args)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started = time.monotonic()
    plan = [
        ("probe", lane.probe),
        ("install", lane.install),
        ("tests", lane.tests),
        ("dry_checks", lane.dry_checks),
        ("bench_single", lambda: lane.bench("bench_single", ["--sections", "single", "--reps", "3"], "gpu_latest.json")),
        ("bench_parallel", lambda: lane.bench("bench_parallel", ["--sections", "ddp,fsdp", "--quick"],
                                              "gpu_parallel_latest.json")),
    ]  # fmt: skip
    for name, fn in plan:
        if name in skip:
            lane.record(name, "skipped", note="--skip")
        elif time.monotonic() > lane.deadline:
            lane.record(name, "skipped", note=f"the lane's budget of {args.budget:.0f} s is spent")
        else:
            try:
                fn()
            except Exception as err:  # one broken step must not hide the others
                lane.record(name, "error", note=f"{type(err).__name__}: {err}"[-1500:])
    summary = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 (Python 3.10 on a bare GPU machine)
        "dry_run": args.dry_run,
        "python": lane.python,
        "elapsed_s": round(time.monotonic() - started, 1),
        "cuda_paths": lane.paths(),
        "steps": lane.steps,
    }
    if args.out:
        out: Path | None = Path(args.out)
    elif lane.keeps_results:
        out = RESULTS / "gpu_lane_latest.json"
    else:  # no GPU here (or a dry run): the summary is printed, and kept outside the work tree
        out = None if args.dry_run else Path(tempfile.mkdtemp(prefix="gpu-lane-")) / "gpu_lane_latest.json"
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n[gpu-lane] summary ({summary['elapsed_s']} s{', dry run' if args.dry_run else ''}):")
    for name, step in lane.steps.items():
        print(f"  {name:15s} {step['status']:8s} {step.get('note', '')}"[:400])
    if out:
        print(f"  wrote {out}")
    bad = [n for n, s in lane.steps.items() if s["status"] in ("failed", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
