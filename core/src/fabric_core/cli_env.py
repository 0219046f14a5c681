"""``fabric env``: everything a bug report needs about this machine and install, in one paste.

Python and the platform, torch and the CUDA/cuDNN/NCCL it was built with, the GPUs torch sees, every installed
Fabric distribution (fabric-core, ours and third parties': anything with a ``fabric.plugins`` entry point or a
requirement on fabric-core) with its version and whether it is an editable install, the versions of related
packages (and of the frameworks each installed plugin names through ``fabric_report_packages``), the state of the
services plugins connect to (``fabric_report_services``: is a cluster reachable?), what ``Fabric()``
would pick here (accelerator, cluster environment), the ``FABRIC_*``/``PL_*`` and launcher variables that are set,
and the CPU threads each process gets.

Versions come from package metadata: no framework is imported (some start a runtime or take seconds to import).
Only torch is imported, for what only it knows. Every section is collected on its own: one that fails shows its
error instead of ending the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from fabric_core.utilities.exceptions import guarded

#: Packages whose versions matter in a report, besides torch and the Fabric distributions (metadata only).
#: The plugins' own frameworks come from their ``fabric_report_packages`` hooks and are shown even when absent.
RELATED_PACKAGES = (
    "numpy", "pluggy", "fsspec", "s3fs", "gcsfs", "torchdata", "tensorboard", "tensorboardX", "lightning-fabric",
    "lightning", "accelerate", "triton",
)  # fmt: skip
#: Variables listed by prefix, and by exact name (the rendezvous, threads, devices).
VARIABLE_PREFIXES = ("FABRIC_", "PL_", "LT_", "TORCHELASTIC_", "NCCL_", "TORCH_", "PJRT_", "XLA_", "DS_")
VARIABLE_NAMES = (
    "MASTER_ADDR", "MASTER_PORT", "STANDALONE_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "NODE_RANK", "GROUP_RANK", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_PROCID", "SLURM_JOB_NAME",
    "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "CPU_NUM_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
)  # fmt: skip
#: A value of a variable whose name contains one of these is replaced by "<hidden>" (reports get pasted publicly).
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
#: Process counts the thread budget is shown for (what our launchers give each of N local processes).
PROCESS_COUNTS = (1, 2, 4, 8)
HIDDEN = "<hidden>"


def _guarded(collect: Callable[[], Any]) -> Any:
    """Run one section's collector; a failure becomes ``{"error": ...}`` so the rest of the report survives (a
    bug-report tool must report, not crash)."""
    found, err = guarded(collect)
    return found if err is None else {"error": f"{type(err).__name__}: {err}"}


# ------------------------------------------------------------------------------------------------- sections


def python_info() -> dict[str, Any]:
    libc, libc_version = platform.libc_ver()
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "libc": f"{libc} {libc_version}".strip() or None,
        "memory_gib": _memory_gib(),
    }


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _metadata_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _editable_location(dist: Any) -> str | None:
    """The source folder of an editable (``pip install -e``) install, from PEP 610's ``direct_url.json``."""
    try:
        text = dist.read_text("direct_url.json")
        if not text:
            return None
        data = json.loads(text)
    except (OSError, ValueError):
        return None
    if data.get("dir_info", {}).get("editable"):
        url = str(data.get("url", ""))
        return url[len("file://") :] if url.startswith("file://") else url
    return None


def fabric_distributions() -> list[dict[str, Any]]:
    """fabric-core and every distribution that plugs into it: a ``fabric.plugins`` entry point, or a requirement on
    fabric-core (a plugin whose entry point is broken still shows up). Metadata only; nothing is imported."""
    import re
    from importlib.metadata import distributions

    from fabric_core.plugins.registry import CORE_DISTRIBUTION, ENTRY_POINT_GROUP, normalise_distribution

    core = normalise_distribution(CORE_DISTRIBUTION)
    found: dict[str, dict[str, Any]] = {}
    for dist in distributions():
        name = dist.metadata["Name"] or ""
        key = normalise_distribution(name)
        if not name or key in found:  # the same distribution visible twice on sys.path: the first one is imported
            continue
        entry_points = [f"{ep.name} = {ep.value}" for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        requires = [r for r in (dist.requires or []) if normalise_distribution(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]) == core]
        if key != core and not entry_points and not requires:
            continue
        found[key] = {
            "name": name,
            "version": dist.version,
            "entry_points": entry_points,
            "requires_core": requires[0] if requires else None,
            "editable": _editable_location(dist),
        }
    return sorted(found.values(), key=lambda d: (normalise_distribution(d["name"]) != core, normalise_distribution(d["name"])))


def related_packages() -> dict[str, str | None]:
    from fabric_core.plugins.host import get_registry

    declared = [name for names in get_registry().plugin_manager.hook.fabric_report_packages() for name in names or ()]
    versions = {name: _metadata_version(name) for name in (*declared, *RELATED_PACKAGES)}
    return {name: v for name, v in versions.items() if v is not None or name in declared}


def services() -> dict[str, str]:
    """What the installed plugins say about the services they connect to (``fabric_report_services``), each plugin
    asked on its own so that one failing or slow answer cannot hide the others'."""
    from fabric_core.plugins.host import get_registry

    found: dict[str, str] = {}
    for impl in get_registry().plugin_manager.hook.fabric_report_services.get_hookimpls():
        answer, err = guarded(impl.function)  # a plugin's code: the report goes on
        if err is not None:
            found[impl.plugin_name] = f"error: {type(err).__name__}: {err}"
            continue
        found.update({str(label): str(state) for label, state in (answer or {}).items()})
    return found


def torch_info() -> dict[str, Any]:
    """torch's version and builds, the GPUs it sees, and torch.distributed's backends."""
    import torch

    info: dict[str, Any] = {
        "version": torch.__version__,
        "debug_build": bool(torch.version.debug),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cudnn": None,
        "nccl": None,
        "cuda_available": False,
        "gpus": [],
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
    }
    try:
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except (RuntimeError, OSError):  # a cuDNN that does not load is reported as absent
        pass
    dist = torch.distributed
    info["distributed"] = {
        "available": dist.is_available(),
        **(
            {
                "gloo": dist.is_gloo_available(),
                "nccl": dist.is_nccl_available(),
                "mpi": dist.is_mpi_available(),
            }
            if dist.is_available()
            else {}
        ),
    }
    if dist.is_available() and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except (RuntimeError, AttributeError):  # a build without NCCL's version call
            pass
    if torch.cuda.is_available():
        info["cuda_available"] = True
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
        info["driver"] = _nvidia_driver()
    return info


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi`` (torch does not expose it), or ``None``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def fabric_choices() -> dict[str, Any]:
    """What ``Fabric()`` would pick here: the auto accelerator and the detected cluster environment, plus plugin
    failures and name conflicts (registration modules are cheap to import; their implementations are not loaded)."""
    from fabric_core.plugins.host import get_registry

    registry = get_registry()
    decisions = registry.decisions
    accelerator = decisions.auto_accelerator() or "cpu"
    environment = decisions.detect_cluster_environment()
    env_info: dict[str, Any] = {"name": getattr(environment, "name", None), "class": None}
    if environment is not None:
        env_info["class"] = f"{type(environment).__module__}.{type(environment).__qualname__}"
        env_info["creates_processes_externally"] = environment.creates_processes_externally
        if environment.creates_processes_externally:  # its ranks come from the launcher's variables
            for field in ("world_size", "global_rank", "local_rank", "node_rank"):
                env_info[field] = _guarded(getattr(environment, field))
            topology = _placement(env_info)
            if topology is not None:
                env_info["topology"] = topology.describe()
    return {
        "auto_accelerator": accelerator,
        "cluster_environment": env_info,
        "plugin_failures": [
            f"{f.distribution}{' ' + f.version if f.version else ''} (plugin {f.plugin!r}, {f.stage}):"
            f" {type(f.error).__name__}: {f.error}"
            for f in registry.failures
        ],
        "conflicts": [f"{c.kind} {c.name!r}: using {c.winner}, ignoring {c.loser}" for c in registry.conflicts],
        "blocked": sorted(set(registry.blocked)),
        "not_loaded": sorted(set(registry.skipped)),
    }


def _placement(env_info: dict[str, Any]) -> Any:
    """The job's placement as the launcher's variables describe it (``LOCAL_WORLD_SIZE`` processes per node; a
    strategy adds its axes once ``Fabric`` runs: ``fabric.topology``), or ``None`` when they do not make one."""
    from fabric_core.utilities.topology import Topology

    world, rank, local = env_info.get("world_size"), env_info.get("global_rank"), env_info.get("local_rank")
    node = env_info.get("node_rank")
    if not all(isinstance(v, int) for v in (world, rank, local, node)):
        return None
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node_count = int(per_node) if per_node.isdigit() and int(per_node) > 0 else world
    if world % per_node_count:
        return None
    return Topology(world // per_node_count, per_node_count, node, local)


def _hidden(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def environment_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``FABRIC_*``, ``PL_*`` and launcher/device variables that are set (secrets hidden), sorted by name."""
    environ = dict(os.environ if environ is None else environ)
    chosen = {
        name: (HIDDEN if _hidden(name) else value)
        for name, value in environ.items()
        if name.startswith(VARIABLE_PREFIXES) or name in VARIABLE_NAMES
    }
    return dict(sorted(chosen.items()))


def threads_info() -> dict[str, Any]:
    """The CPU budget: cores, the ones this process may use, torch's thread pools, and what our launchers give each
    of N local processes (``cpu_count // N``, unless ``OMP_NUM_THREADS`` is set)."""
    from fabric_core.utilities.topology import threads_per_process

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "usable_cpus": usable}
    try:
        import torch

        info["torch_intra_op"] = torch.get_num_threads()
        info["torch_inter_op"] = torch.get_num_interop_threads()
    except (ImportError, RuntimeError) as err:
        info["torch"] = f"{type(err).__name__}: {err}"
    omp = os.environ.get("OMP_NUM_THREADS")
    info["OMP_NUM_THREADS"] = omp
    info["per_process"] = {str(n): (int(omp) if omp and omp.isdigit() else threads_per_process(n)) for n in PROCESS_COUNTS}
    return info


def collect() -> dict[str, Any]:
    """The whole report as plain data (what ``fabric env --json`` prints)."""
    def core_version() -> str:
        from fabric_core import __version__

        return __version__

    return {
        "fabric_core_version": _guarded(core_version),
        "python": _guarded(python_info),
        "fabric_distributions": _guarded(fabric_distributions),
        "packages": _guarded(related_packages),
        "services": _guarded(services),
        "torch": _guarded(torch_info),
        "fabric": _guarded(fabric_choices),
        "threads": _guarded(threads_info),
        "environment_variables": _guarded(environment_variables),
    }


# ------------------------------------------------------------------------------------------------- rendering


def _line(label: str, value: Any) -> str:
    return f"  {label + ':':<28} {value}"


def _section_error(section: Any) -> str | None:
    return section.get("error") if isinstance(section, dict) and set(section) == {"error"} else None


def format_report(report: dict[str, Any]) -> str:
    """Render :func:`collect`'s report for people (and for pasting into an issue)."""
    out = ["Paste this into your bug report (`fabric env --json` prints the same as JSON).", ""]

    def section(title: str, key: str, render: Callable[[Any], list[str]]) -> None:
        data = report.get(key)
        out.append(title)
        error = _section_error(data)
        out.extend([_line("error", error)] if error else render(data))
        out.append("")

    def python(p: dict[str, Any]) -> list[str]:
        return [
            _line("Python", f"{p['version']} ({p['implementation']}) {p['executable']}"),
            _line("Platform", f"{p['platform']} ({p['machine']}{', ' + p['libc'] if p['libc'] else ''})"),
            _line("Memory", f"{p['memory_gib']} GiB" if p["memory_gib"] is not None else "unknown"),
        ]

    def dists(items: list[dict[str, Any]]) -> list[str]:
        lines = []
        for d in items:
            extra = f" (editable: {d['editable']})" if d["editable"] else ""
            lines.append(_line(d["name"], f"{d['version']}{extra}"))
            for ep in d["entry_points"]:
                lines.append(f"  {'':<28}   entry point {ep}")
        return lines or [_line("none", "fabric-core is not installed as a distribution")]

    def packages(p: dict[str, Any]) -> list[str]:
        return [_line(name, version or "not installed") for name, version in p.items()]

    def torch_lines(t: dict[str, Any]) -> list[str]:
        lines = [
            _line("torch", t["version"]),
            _line("CUDA (build)", f"ROCm {t['hip_build']}" if t["hip_build"] else (t["cuda_build"] or "none (CPU build)")),
            _line("cuDNN", t["cudnn"] or "-"),
            _line("NCCL", t["nccl"] or "-"),
            _line("CUDA available", t["cuda_available"]),
        ]
        if t.get("driver"):
            lines.append(_line("NVIDIA driver", t["driver"]))
        for gpu in t["gpus"]:
            lines.append(_line(f"GPU {gpu['index']}", f"{gpu['name']} (sm {gpu['capability']}, {gpu['memory_gib']} GiB)"))
        lines.append(_line("MPS available", t["mps_available"]))
        d = t["distributed"]
        backends = ", ".join(b for b in ("gloo", "nccl", "mpi") if d.get(b)) or "none"
        lines.append(_line("torch.distributed", f"backends: {backends}" if d["available"] else "not available"))
        return lines

    def fabric(f: dict[str, Any]) -> list[str]:
        env = f["cluster_environment"]
        where = env["name"] or "none"
        if env.get("creates_processes_externally") and "world_size" in env:
            where += f" (world size {env['world_size']}, rank {env['global_rank']}, local rank {env['local_rank']}, node {env['node_rank']})"
        lines = [_line("auto accelerator", f["auto_accelerator"]), _line("cluster environment", where)]
        if env.get("topology"):
            lines.append(_line("topology", env["topology"]))
        for failure in f["plugin_failures"]:
            lines.append(_line("plugin failure", failure))
        for conflict in f["conflicts"]:
            lines.append(_line("name conflict", conflict))
        if f["blocked"]:
            lines.append(_line("switched off", ", ".join(f["blocked"])))
        if f["not_loaded"]:
            lines.append(_line("not loaded (autoload off)", ", ".join(f["not_loaded"])))
        return lines

    def threads(t: dict[str, Any]) -> list[str]:
        per = ", ".join(f"{n} -> {v}" for n, v in t["per_process"].items())
        return [
            _line("CPUs (usable)", f"{t['cpu_count']} ({t['usable_cpus']})"),
            _line("torch threads (intra/inter)", f"{t.get('torch_intra_op', '?')}/{t.get('torch_inter_op', '?')}"),
            _line("OMP_NUM_THREADS", t["OMP_NUM_THREADS"] or "not set"),
            _line("per process (N processes)", per),
        ]

    def variables(v: dict[str, str]) -> list[str]:
        return [_line(name, value) for name, value in v.items()] or [_line("none", "no FABRIC_*, PL_* or launcher variables set")]

    section("Python", "python", python)
    section("Fabric distributions", "fabric_distributions", dists)
    section("Packages", "packages", packages)
    if report.get("services"):  # only when a plugin reports one
        section("Services", "services", lambda v: [_line(label, state) for label, state in v.items()])
    section("PyTorch", "torch", torch_lines)
    section("What Fabric() picks here", "fabric", fabric)
    section("Threads", "threads", threads)
    section("Environment variables", "environment_variables", variables)
    return "\n".join(out).rstrip() + "\n"


def env_main(args: argparse.Namespace) -> int:
    import warnings

    from fabric_core.plugins.registry import FabricPluginWarning

    with warnings.catch_warnings():  # plugin failures are part of the report; don't print them twice
        warnings.simplefilter("ignore", FabricPluginWarning)
        report = collect()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        sys.stdout.write(format_report(report))
    return 0


def add_env_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "env",
        help="print versions, devices and settings for a bug report",
        description=(
            "Print Python, torch (CUDA, cuDNN, NCCL, GPUs), every installed Fabric distribution and related package"
            " with its version, what Fabric() would pick here (accelerator, cluster environment), the FABRIC_*,"
            " PL_* and launcher variables that are set, and the CPU threads per process. Paste it into bug reports."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(handler=env_main)
    return parser
