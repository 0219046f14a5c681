"""The GPU lane: everything to run on the first GPU machine we get, in one command (``make gpu-lane``, <= 8 minutes).

    python benchmarks/gpu_lane.py             # on a machine with an NVIDIA GPU
    python benchmarks/gpu_lane.py --dry-run   # anywhere: checks the wiring; nothing installed, CUDA tests skip

Steps, each with its own timeout (and all of them within ``--budget`` seconds):

1. ``probe``: the interpreter, its torch (and whether it has CUDA), the GPUs (``nvidia-smi``).
2. ``install``: only what is missing. An interpreter whose torch already sees a GPU is used as it is; otherwise a
   venv ``.venv-gpu`` (with the system's site-packages, so a preinstalled CUDA torch is reused) gets the pinned torch
   from the registry. Then fabric-core and the GPU plugins (editable, ``--no-deps``, no build isolation: works
   offline) and the test tools and DeepSpeed when they are missing, torch held at its installed version. A step
   that fails (no network, say) is reported and the lane goes on: the tests that need what is missing skip.
3. ``tests``: every test marked ``cuda`` (``pytest -m cuda`` over the files that hold them: the tests skipped on a
   CPU machine for lack of CUDA, and the CUDA-only tests of ``tests/gpu/``).
4. ``bench_single``: ``benchmarks/gpu_bench.py`` single-device section (raw loop vs ours, steps paired in one
   process, GPT-2-small-sized model, bf16-mixed: tokens/s and MFU).
5. ``bench_parallel``: its DDP and FSDP sections (torchrun over every visible GPU), one repetition.

Results go to ``benchmarks/results/``: ``gpu_lane_latest.json`` (this summary), ``gpu_latest.json`` and
``gpu_parallel_latest.json`` (the benchmark's). ``--dry-run`` installs nothing, runs the CUDA tests here (they
must all skip, none fail) and the benchmark's no-CUDA path, and writes its summary to ``--out`` only.
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
LANE_VENV = REPO / ".venv-gpu"
#: The distributions the GPU paths need (the trackers and XLA have no CUDA path of their own).
GPU_DISTS = ("core", "plugins/ddp", "plugins/amp", "plugins/fsdp", "plugins/deepspeed")
#: Test tools the lane needs, installed only when missing.
TEST_TOOLS = ("pluggy>=1.3", "pytest>=8", "pytest-timeout>=2.3", "psutil>=5.9", "numpy>=1.26", "setuptools>=77", "wheel")
#: Seconds per step; each is also cut to what is left of ``--budget``.
TIMEOUTS = {"probe": 90, "install": 240, "tests": 240, "bench_single": 200, "bench_parallel": 200}

PROBE = r"""
import json, sys
out = {"python": sys.executable, "version": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if out["cuda_available"] else []
except Exception as err:
    out.update(torch=None, error=f"{type(err).__name__}: {err}")
import importlib.util as u
out["modules"] = {m: u.find_spec(m) is not None for m in
    ("fabric_core", "fabric_ddp", "fabric_amp", "fabric_fsdp", "fabric_deepspeed", "deepspeed", "pytest", "pytest_timeout")}
print(json.dumps(out))
"""


class Lane:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.deadline = time.monotonic() + args.budget
        self.steps: dict[str, dict[str, Any]] = {}

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
                env={**os.environ, **(env or {})}, start_new_session=True,
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
        return {"cmd": " ".join(str(c) for c in cmd), "code": code, "seconds": round(time.monotonic() - t0, 1),
                "tail": out[-2500:]}  # fmt: skip

    def record(self, step: str, status: str, **info: Any) -> dict[str, Any]:
        self.steps[step] = {"status": status, **info}
        line = f"[gpu-lane] {step}: {status}"
        if info.get("note"):
            line += f" ({info['note']})"
        print(line, flush=True)
        return self.steps[step]

    def probe_python(self, python: str, timeout: float) -> dict[str, Any] | None:
        res = self.run([python, "-c", PROBE], timeout)
        if res["code"] != 0:
            return None
        try:
            return json.loads(res["tail"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None

    # -------------------------------------------------------------------------------------------- steps
    def probe(self) -> None:
        timeout = self.timeout("probe")
        candidates = [self.args.python] if self.args.python else []
        candidates += [str(LANE_VENV / "bin" / "python"), str(REPO / ".venv" / "bin" / "python"), sys.executable]
        seen, found = set(), []
        for python in candidates:
            if python in seen or not Path(python).exists():
                continue
            seen.add(python)
            info = self.probe_python(python, timeout)
            if info is not None:
                found.append(info)
        smi = shutil.which("nvidia-smi")
        gpus = (
            self.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 30)
            if smi
            else {"code": None, "tail": "nvidia-smi not found"}
        )
        self.gpu_visible = gpus.get("code") == 0 and bool(gpus["tail"].strip())
        with_cuda = [f for f in found if f.get("cuda_available")]
        with_torch = [f for f in found if f.get("torch")]
        self.python_info = (with_cuda or with_torch or [{"python": sys.executable, "torch": None}])[0]
        self.python = self.python_info["python"]
        note = (
            f"{self.python}: torch {self.python_info.get('torch')} (CUDA {self.python_info.get('torch_cuda')},"
            f" available: {self.python_info.get('cuda_available')}); GPUs: "
            + (gpus["tail"].strip().replace("\n", "; ") if self.gpu_visible else "none visible")
        )
        self.record("probe", "ok", note=note, interpreters=found, nvidia_smi=gpus["tail"].strip())

    def install(self) -> None:
        info, planned, done, skipped = self.python_info, [], [], []
        python = self.python
        if info.get("cuda_available"):
            skipped.append(f"torch: {info['python']} already has torch {info['torch']} with CUDA {info['torch_cuda']}")
        elif not self.gpu_visible and not self.dry:
            skipped.append("torch: no GPU is visible (nvidia-smi), so no CUDA torch is installed")
        else:
            pin = re.search(r"^torch==(\S+)", (REPO / "requirements-dev.txt").read_text(), re.M).group(1)
            base = self.args.base_python or sys.executable
            if not (LANE_VENV / "bin" / "python").exists():
                planned.append([base, "-m", "venv", "--system-site-packages", str(LANE_VENV)])
            python = str(LANE_VENV / "bin" / "python")
            index = ["--index-url", self.args.torch_index] if self.args.torch_index else []
            # the registry's default Linux wheel of torch is the CUDA build (it brings the nvidia-* libraries)
            planned.append([python, "-m", "pip", "install", f"torch=={pin}", *index])
        missing = [m for m, ok in info.get("modules", {}).items() if not ok] if python == info["python"] else None
        if missing is None or {"pytest", "pytest_timeout"} & set(missing):
            planned.append([python, "-m", "pip", "install", *TEST_TOOLS])
        else:
            skipped.append("test tools: already importable")
        if missing is None or {"fabric_core", "fabric_ddp", "fabric_amp", "fabric_fsdp", "fabric_deepspeed"} & set(missing):
            editable = [a for d in GPU_DISTS for a in ("-e", str(REPO / d))]
            planned.append([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", *editable])
        else:
            skipped.append("fabric-core and the GPU plugins: already importable")
        if missing is None or "deepspeed" in missing:
            ds = re.search(r'"(deepspeed==[^"]+)"', (REPO / "plugins/deepspeed/pyproject.toml").read_text()).group(1)
            # torch is held at whatever is installed by then (a constraint written just before the command runs)
            planned.append([python, "-m", "pip", "install", "--no-build-isolation", ds, "--constraint", "@TORCH"])
        else:
            skipped.append("deepspeed: already importable")
        if self.dry:
            self.record("install", "skipped", note="dry run: nothing installed", would_run=[" ".join(c) for c in planned],
                        skipped=skipped)  # fmt: skip
            return
        self.python = python
        failures = []
        for cmd in planned:
            if "@TORCH" in cmd:
                now = self.probe_python(python, 60) or {}
                constraint = Path(tempfile.mkdtemp()) / "torch.txt"
                constraint.write_text(f"torch=={now.get('torch', '').split('+')[0]}\n" if now.get("torch") else "")
                cmd = [str(constraint) if c == "@TORCH" else c for c in cmd]
            res = self.run(cmd, self.timeout("install"))
            (done if res["code"] == 0 else failures).append(res)
        after = self.probe_python(python, 90) or {}
        self.python_info = after or self.python_info
        status = "ok" if not failures else "partial"
        note = f"torch {after.get('torch')} CUDA available: {after.get('cuda_available')}"
        if failures:
            note += f"; {len(failures)} install command(s) failed (no network?): the tests that need them skip"
        self.record("install", status, note=note, ran=done, failed=failures, skipped=skipped)

    def cuda_test_files(self) -> list[str]:
        """The test files that hold a test marked ``cuda`` (the lane's selection; tests/benchmarks checks that every
        test skipped for lack of CUDA is marked so)."""
        files = []
        for path in sorted((REPO / "tests").rglob("test_*.py")):
            if re.search(r"pytest\.mark\.cuda\b", path.read_text(errors="replace")):
                files.append(str(path.relative_to(REPO)))
        return files

    def tests(self) -> None:
        files = self.cuda_test_files()
        xml = Path(tempfile.mkdtemp()) / "cuda.xml"
        # no `-n`: pytest-xdist may be absent on a bare machine; the jobs inside the tests are the parallel part
        cmd = [self.python, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *files]  # fmt: skip
        res = self.run(cmd, self.timeout("tests"), env={"PYTHONWARNINGS": "ignore"})
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        failed_ids: list[str] = []
        skip_reasons: set[str] = set()
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                if case.find("failure") is not None:
                    counts["failed"] += 1
                    failed_ids.append(name)
                elif case.find("error") is not None:
                    counts["errors"] += 1
                    failed_ids.append(name)
                elif (skip := case.find("skipped")) is not None:
                    counts["skipped"] += 1
                    skip_reasons.add((skip.get("message") or "").strip()[:200])
                else:
                    counts["passed"] += 1
        # pytest exits 5 when nothing was collected, 0 when everything passed or skipped
        ok = res["code"] == 0 and not counts["failed"] and not counts["errors"]
        note = ", ".join(f"{n} {k}" for k, n in counts.items())
        self.record("tests", "ok" if ok else "failed", note=note, files=files, counts=counts, failed=failed_ids,
                    skip_reasons=sorted(skip_reasons), run=res)  # fmt: skip

    def bench(self, step: str, extra: list[str], out_name: str) -> None:
        out = (
            Path(tempfile.mkdtemp()) / out_name
            if self.dry
            else RESULTS / out_name
        )
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="check the wiring here: install nothing, CUDA tests skip")
    p.add_argument("--budget", type=float, default=470, help="seconds for the whole lane (default 470, under 8 min)")
    p.add_argument("--python", default=None, help="interpreter to test with (default: the first with CUDA torch)")
    p.add_argument("--base-python", default=None, help="interpreter .venv-gpu is made from (default: this one)")
    p.add_argument("--torch-index", default=None, help="pip --index-url for torch (default: the registry's)")
    p.add_argument("--out", default=None, help="the summary JSON (default benchmarks/results/gpu_lane_latest.json)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out (e.g. bench_parallel)")
    args = p.parse_args(argv)
    lane = Lane(args)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started = time.monotonic()
    plan = [
        ("probe", lane.probe),
        ("install", lane.install),
        ("tests", lane.tests),
        ("bench_single", lambda: lane.bench("bench_single", ["--sections", "single", "--reps", "5"], "gpu_latest.json")),
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
        "python": lane.python if hasattr(lane, "python") else None,
        "elapsed_s": round(time.monotonic() - started, 1),
        "steps": lane.steps,
    }
    out = Path(args.out) if args.out else (None if args.dry_run else RESULTS / "gpu_lane_latest.json")
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
