"""The bare-install lane: our wheels in a fresh venv that holds only torch, as a user installs them with pip.

``make test-bare`` (and ``.ci/run``) runs it with any Python 3.10+; it needs only the standard library here and
a package index for the venv (``pip install torch==2.13.0`` takes the local CPU wheel on our machines). Steps:

1. Create ``.bare/venv`` afresh with ``pip install torch==<the pin in requirements-dev.txt>``; numpy is absent.
2. Build a wheel of every distribution (``core/`` and each ``plugins/*/``) from a copy of its sources, with the
   setuptools torch brought along; the build's output must hold no warning (setuptools' deprecation warnings
   were a page per install once).
3. ``fabric-core[ddp,amp,xla]`` from the wheels: numpy must still be absent (fabric-core and fabric-ddp do not
   need it); the seed articles' calls (``seeds_calls.py``) run on 2 CPU processes with ``ddp``.
4. ``fabric-core[fsdp]``: numpy arrives as fabric-fsdp's declared dependency; the calls run with ``fsdp``.
5. ``fabric-core[deepspeed]`` (pip builds deepspeed's sdist against the installed CPU torch): the calls run with
   ``deepspeed``.
6. The remaining distributions (e.g. the trackers), then ``fabric-core[all]`` when every extra's distribution
   exists here; ``fabric plugins --check`` and ``fabric-core plugins --check`` must pass; the trackers log by name
   (``Fabric(loggers=[{"mlflow": ...}, {"wandb": ...}])``) and their runs read back (``trackers_calls.py``).

After every install: the pinned torch is still the one installed, no CUDA packages came along, and pip's output
names no warning or deprecation for a distribution of ours. Each run has a time limit and its whole process
group is killed when it overruns. Exit status 0 when everything passed; the time of each step is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
WORK = REPO / ".bare"
VENV = WORK / "venv"
PY = VENV / "bin" / "python"
SCENARIO = Path(__file__).with_name("seeds_calls.py")
TRACKERS_SCENARIO = Path(__file__).with_name("trackers_calls.py")
RUN_TIMEOUT = 420
#: pip's notices about this machine's extra package locations, not about what is installed
_ENVIRONMENT_NOISE = re.compile(r"^WARNING: Location '.*' is ignored")
_WARNING = re.compile(r"warn|deprecat", re.IGNORECASE)


class LaneError(RuntimeError):
    pass


def step(title: str) -> float:
    print(f"\n=== bare-install lane: {title}", flush=True)
    return time.perf_counter()


def done(start: float, timings: dict[str, float], title: str) -> None:
    timings[title] = time.perf_counter() - start
    print(f"--- {title}: {timings[title]:.1f} s", flush=True)


def run(command: list[str], timeout: float = 900, env: dict[str, str] | None = None) -> str:
    """Run ``command`` in its own process group; its output (stdout and stderr) is returned and echoed on failure."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=WORK,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        print(output)
        raise LaneError(f"timed out after {timeout} s: {' '.join(command)}") from None
    if proc.returncode != 0:
        print(output)
        raise LaneError(f"exit status {proc.returncode}: {' '.join(command)}")
    return output


def our_warnings(output: str, distributions: list[str], strict: bool) -> list[str]:
    """Lines of pip's output that warn; with ``strict`` every warning, otherwise those naming one of ours."""
    names = {d.lower() for d in distributions} | {d.replace("-", "_").lower() for d in distributions}
    found = []
    for line in output.splitlines():
        if _ENVIRONMENT_NOISE.search(line) or not _WARNING.search(line):
            continue
        if strict or any(name in line.lower() for name in names):
            found.append(line.strip())
    return found


def distributions() -> dict[str, Path]:
    """Every distribution of the repository: name -> source folder."""
    found = {}
    for folder in [REPO / "core", *sorted((REPO / "plugins").iterdir())]:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            match = re.search(r'^name\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if match:
                found[match.group(1)] = folder
    return found


def build_wheels(sources: dict[str, Path]) -> dict[str, Path]:
    """Wheels built from copies of the sources (an in-tree build would leave build/ and *.egg-info behind)."""
    copies, wheels = WORK / "src", WORK / "wheels"
    for folder in (copies, wheels):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    targets = []
    for name, source in sources.items():
        copy = copies / name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        targets.append(str(copy))
    # Our build backend is setuptools >= 77, which torch itself requires: the venv's own setuptools builds them.
    command = [str(PY), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels)]
    output = run([*command, *targets])
    warned = our_warnings(output, list(sources), strict=True)
    if warned:
        raise LaneError("building the wheels printed warnings:\n  " + "\n  ".join(warned))
    built = {}
    for name in sources:
        prefix = name.replace("-", "_") + "-"
        matches = [w for w in wheels.glob("*.whl") if w.name.startswith(prefix)]
        if len(matches) != 1:
            raise LaneError(f"expected one wheel of {name}, found {[m.name for m in matches]}")
        built[name] = matches[0]
    return built


def core_extras() -> dict[str, list[str]]:
    """fabric-core's extras and the distributions of ours each one asks for."""
    text = (REPO / "core" / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras: dict[str, list[str]] = {}
    for match in re.finditer(r"^(\w+)\s*=\s*\[(.*?)\]", section, re.M | re.S):
        requirements = re.findall(r'"([^"]+)"', match.group(2))
        extras[match.group(1)] = [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements]
    return extras


def install(wheels: dict[str, Path], extras: list[str], names: list[str]) -> None:
    """``pip install "<fabric-core wheel>[extras]" <the wheels of names>``; pip's output is checked."""
    core = f"{wheels['fabric-core']}[{','.join(extras)}]" if extras else str(wheels["fabric-core"])
    # The plugins ask for ranges; CI installs the exact versions of constraints.txt, as `make setup` does.
    output = run([str(PY), "-m", "pip", "install", "-c", str(CONSTRAINTS), core, *(str(wheels[n]) for n in names)])
    warned = our_warnings(output, list(wheels), strict=False)
    if warned:
        raise LaneError("pip install printed warnings about our distributions:\n  " + "\n  ".join(warned))
    check_torch()


def check_torch() -> None:
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements-dev.txt").read_text(), re.M).group(1)
    code = (
        "import importlib.metadata as m, torch;"
        "cuda = sorted(d.metadata['Name'] for d in m.distributions()"
        " if d.metadata['Name'].lower().startswith(('nvidia-', 'triton')));"
        f"assert torch.__version__.split('+')[0] == {pin!r} and not cuda, (torch.__version__, cuda)"
    )
    run([str(PY), "-c", code])


def has_numpy() -> bool:
    return run([str(PY), "-c", "import importlib.util; print(importlib.util.find_spec('numpy') is not None)"]).strip() == "True"


def seeds_calls(strategy: str) -> None:
    out = WORK / "out" / strategy
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "PL_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    output = run([str(PY), str(SCENARIO), strategy, str(out)], timeout=RUN_TIMEOUT, env=env)
    # Both ranks write to one pipe, so their lines may interleave: look for each rank's marker, not whole lines.
    oks = sorted(re.findall(r"\[rank (\d+)\] seeds-calls ok", output))
    if oks != ["0", "1"]:
        print(output)
        raise LaneError(f"{strategy}: expected both ranks to report success, got {oks}")
    print("\n".join(oks), flush=True)


def main() -> int:
    timings: dict[str, float] = {}
    total = time.perf_counter()
    WORK.mkdir(exist_ok=True)

    start = step("fresh venv with only torch")
    shutil.rmtree(VENV, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(VENV)])
    run([str(PY), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    pin = re.search(r"^torch==\S+", (REPO / "requirements-dev.txt").read_text(), re.M).group(0)
    run([str(PY), "-m", "pip", "install", pin])
    check_torch()
    if has_numpy():
        raise LaneError("the fresh venv has numpy before anything of ours was installed")
    done(start, timings, "venv + torch")

    start = step("wheels of every distribution")
    sources = distributions()
    wheels = build_wheels(sources)
    print("built: " + ", ".join(w.name for w in wheels.values()), flush=True)
    done(start, timings, "wheels")

    extras = core_extras()
    first = [e for e in ("ddp", "amp", "xla") if e in extras]
    start = step(f"fabric-core[{','.join(first)}] and 2-process ddp")
    install(wheels, first, [d for e in first for d in extras[e]])
    if has_numpy():
        raise LaneError("numpy was installed with fabric-core, fabric-ddp, fabric-amp or fabric-xla, which do not need it")
    seeds_calls("ddp")
    done(start, timings, "ddp")

    start = step("fabric-core[fsdp] and 2-process fsdp")
    install(wheels, ["fsdp"], extras["fsdp"])
    seeds_calls("fsdp")
    done(start, timings, "fsdp")

    start = step("fabric-core[deepspeed] and 2-process deepspeed")
    install(wheels, ["deepspeed"], extras["deepspeed"])
    seeds_calls("deepspeed")
    done(start, timings, "deepspeed")

    start = step("every other distribution, fabric-core[all], `fabric plugins --check`")
    installed = {d for e in ("ddp", "amp", "xla", "fsdp", "deepspeed") for d in extras.get(e, [])}
    rest = [name for name in wheels if name != "fabric-core" and name not in installed]
    ours = [d for d in extras.get("all", []) if d.startswith("fabric-")]
    missing = [d for d in ours if d not in wheels]
    if missing:
        print(f"not in this repository (yet), so [all] is not installed: {', '.join(missing)}", flush=True)
        install(wheels, [], rest)
    else:
        install(wheels, ["all"], rest)
    for script in ("fabric", "fabric-core"):
        print(run([str(VENV / "bin" / script), "plugins", "--check"]), flush=True)
    if {"fabric-wandb", "fabric-mlflow"} <= set(wheels):
        out = WORK / "out" / "trackers"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "MLFLOW_", "WANDB_"))}
        output = run([str(PY), str(TRACKERS_SCENARIO), str(out)], timeout=RUN_TIMEOUT, env=env)
        if "trackers-calls ok" not in output:
            print(output)
            raise LaneError("the trackers did not log by name after a plain pip install")
        print("trackers-calls ok", flush=True)
    done(start, timings, "rest")

    timings["total"] = time.perf_counter() - total
    print("\nbare-install lane passed: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LaneError as err:
        print(f"\nbare-install lane FAILED: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
