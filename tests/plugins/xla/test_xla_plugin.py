"""fabric-xla's plugin side, in any venv (with or without torch_xla): names, laziness, hooks, device parsing, CLI.

Nothing here starts the XLA runtime. In the main venv torch_xla is absent, which is exactly the situation laziness
must survive; the XLA lane runs these again with torch_xla installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from jobs import fabric_command, job_env

from fabric_core import Fabric
from fabric_core.plugins import build_registry
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_xla import detect, register
from fabric_xla.accelerator import XLAAccelerator, parse_xla_devices
from fabric_xla.precision import XLAPrecision

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def _env(**extra: str) -> dict[str, str]:
    """A job's clean environment without the PJRT device settings of the lane (``extra`` may set them again)."""
    env = {k: v for k, v in job_env().items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return {**env, **extra}


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, env=_env(**env)
    )


@pytest.fixture
def xla_cpu(monkeypatch: pytest.MonkeyPatch):
    """An XLA accelerator object on the CPU PJRT device, as the lane runs it (no runtime is started here)."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    return XLAAccelerator()


# ------------------------------------------------------------------------------------------------ names
def test_names_and_kinds():
    registry = build_registry()
    names = {kind: {e.name for e in registry.entries(kind) if e.distribution == "fabric-xla"} for kind in ("accelerator", "strategy", "launcher", "environment", "precision")}
    assert names == {
        "accelerator": {"tpu"},
        "strategy": {"single_xla", "xla", "xla_fsdp"},
        "launcher": {"xla"},
        "environment": {"xla"},
        "precision": set(),  # XLAPrecision is chosen by fabric_select_precision for the XLA strategies
    }
    assert registry.lookup("accelerator", "XLA").name == "tpu"
    assert registry.get("launcher", "xla").load().requires_function


# ------------------------------------------------------------------------------------------------ laziness
LAZY_CHECK = """
    import sys
    from fabric_core import Fabric
    from fabric_core.plugins import get_registry
    Fabric(accelerator="cpu")
    Fabric(accelerator="auto")
    Fabric(accelerator="cpu", strategy="single_device", precision="bf16-true")
    get_registry()
    heavy = sorted(m for m in sys.modules if m.startswith("torch_xla") or m in (
        "fabric_xla.strategy", "fabric_xla.accelerator", "fabric_xla.runtime", "fabric_xla.sharding", "fabric_xla.launcher"))
    print("HEAVY", heavy)
    print("LOADED", "fabric_xla.register" in sys.modules)
"""


@pytest.mark.parametrize("pjrt", ["", "CPU"], ids=["no-PJRT_DEVICE", "PJRT_DEVICE=CPU"])
def test_cpu_and_auto_import_nothing_from_torch_xla(pjrt: str):
    """With fabric-xla installed and no TPU, a CPU run (also accelerator="auto") never imports torch_xla."""
    done = _python(LAZY_CHECK, **({"PJRT_DEVICE": pjrt} if pjrt else {}))
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "LOADED True" in done.stdout, done.stdout + done.stderr


def test_fabric_plugins_check_finds_no_heavy_registration_module():
    done = subprocess.run(
        [sys.executable, "-m", "fabric_core", "plugins", "--check", "--json"], capture_output=True, text=True, timeout=180, env=_env()
    )
    report = json.loads(done.stdout)
    plugin = next(p for p in report["plugins"] if p["distribution"] == "fabric-xla")
    assert plugin["heavy_imports"] == []
    assert sorted(plugin["decision_hooks"]) == [
        "fabric_adjust_strategy", "fabric_auto_accelerator", "fabric_auto_strategy", "fabric_select_precision",
    ]  # fmt: skip
    statuses = {(e["kind"], e["name"]): e["status"] for e in report["entries"] if e["distribution"] == "fabric-xla"}
    assert statuses[("accelerator", "tpu")] == "unavailable"  # no TPU here, and PJRT_DEVICE is not set
    assert {v for k, v in statuses.items() if k[0] != "accelerator"} == {"available"}
    assert not [f for f in report["failures"] if f["distribution"] == "fabric-xla"]


# ------------------------------------------------------------------------------------------------ detection and devices
def test_detection_reads_the_environment_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert not detect.tpu_present()  # no TPU on the machines that run this suite
    assert register.fabric_auto_accelerator(build_registry()) is None
    assert not XLAAccelerator.is_available()
    monkeypatch.setenv("PJRT_DEVICE", "cpu")
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    assert detect.device_count() == 4
    assert XLAAccelerator.is_available() is HAS_TORCH_XLA  # an explicit PJRT device needs only torch_xla
    assert register.fabric_auto_accelerator(build_registry()) is None  # "auto" picks a real TPU only
    monkeypatch.setattr(detect, "tpu_present", lambda: True)
    assert register.fabric_auto_accelerator(build_registry()) == "tpu"


@pytest.mark.parametrize(
    ("accelerator_type", "flops"),
    [("v4-8", 275e12), ("v5litepod-16", 197e12), ("v5p-128", 459e12), ("v6e-4", 918e12), ("v3-8", 61.5e12), ("v9-8", None)],
)
def test_peak_flops_per_device_of_each_tpu_generation(monkeypatch: pytest.MonkeyPatch, accelerator_type, flops):
    from fabric_core.runtime.throughput import get_available_flops

    monkeypatch.delenv("ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator_type)
    assert XLAAccelerator.available_flops(torch.device("xla", 0), torch.float32) == flops
    # the throughput utilities ask the accelerator registered for the device type (an unknown generation warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_available_flops(torch.device("xla", 0), torch.bfloat16) == (int(flops) if flops else None)
    assert bool(caught) is (flops is None)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    assert XLAAccelerator.available_flops(torch.device("xla", 0), torch.bfloat16) is None  # no TPU here


@pytest.mark.parametrize(
    ("devices", "expected"),
    [("auto", [0, 1, 2, 3]), (4, [0, 1, 2, 3]), ("4", [0, 1, 2, 3]), (1, [0]), ("1", [0]), ([2], [2]), ("3,", [3]), ("[1]", [1])],
)
def test_device_parsing(devices, expected):
    assert parse_xla_devices(devices, 4) == expected


@pytest.mark.parametrize(("devices", "error"), [(2, ValueError), ([0, 1], ValueError), ([4], ValueError), ("x", ValueError), (2.0, TypeError), (["0"], TypeError), (-1, ValueError)])
def test_device_parsing_refuses_what_torch_xla_cannot_run(devices, error):
    with pytest.raises(error, match=r"`devices` can only be 'auto', 1, 4 or \[<0-3>\] for TPUs\."):
        parse_xla_devices(devices, 4)


# ------------------------------------------------------------------------------------------------ decisions
def test_auto_strategy_and_fsdp_on_xla(xla_cpu):
    registry = build_registry()
    assert register.fabric_auto_strategy(registry, xla_cpu, 1, 1, False) == "single_xla"
    assert register.fabric_auto_strategy(registry, xla_cpu, 2, 1, False) == "xla"
    assert register.fabric_auto_strategy(registry, xla_cpu, 1, 2, False) == "xla"
    assert register.fabric_adjust_strategy(registry, "fsdp", xla_cpu, 2, 1) == "xla_fsdp"
    assert register.fabric_adjust_strategy(registry, "xla", xla_cpu, 2, 1) is None
    cpu = build_registry().get("accelerator", "cpu").create()
    assert register.fabric_auto_strategy(registry, cpu, 2, 1, False) is None
    assert register.fabric_adjust_strategy(registry, "fsdp", cpu, 2, 1) is None


def test_non_xla_strategies_are_refused_on_xla_devices(xla_cpu):
    message = r"The `XLAAccelerator` can only be used with a `SingleDeviceXLAStrategy`, `XLAStrategy`, or `XLAFSDPStrategy`\."
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator=xla_cpu, strategy="single_device", devices=1)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator=xla_cpu, strategy=SingleDeviceStrategy(), devices=1)
    with pytest.raises(ValueError, match="runs on XLA devices, but the accelerator is 'cpu'"):
        Fabric(accelerator="cpu", strategy="xla_fsdp")


def test_xla_strategy_resolves_without_touching_torch_xla(xla_cpu):
    """``strategy="xla"`` is built in the launching process without torch_xla: the runtime must stay untouched."""
    fabric = Fabric(accelerator=xla_cpu, strategy="xla", devices=2, precision="bf16-mixed")
    assert type(fabric.strategy).__name__ == "XLAStrategy"
    assert type(fabric.strategy.launcher).__name__ == "XLALauncher"
    assert (fabric.world_size, fabric.global_rank, fabric.device) == (2, 0, torch.device("xla", 0))
    assert isinstance(fabric.strategy.precision, XLAPrecision) and fabric.strategy.precision.precision == "bf16-mixed"
    assert fabric.strategy.cluster_environment is None  # each replica makes its XLAEnvironment when it starts
    with pytest.raises(TypeError, match=r"To spawn processes with the `XLAStrategy` strategy, `\.launch\(\)` needs"):
        fabric.launch()
    if not HAS_TORCH_XLA:
        assert "torch_xla" not in sys.modules


@pytest.mark.parametrize("precision", ["16-mixed", "64-true", "16"])
def test_precisions_xla_cannot_run_are_refused(xla_cpu, precision):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `precision=16` is a legacy spelling (fabric-amp warns when installed)
        with pytest.raises(ValueError, match="is not supported by the XLA strategies"):
            Fabric(accelerator=xla_cpu, strategy="xla", devices=2, precision=precision)


def test_bf16_mixed_without_fabric_amp_and_the_legacy_spelling(xla_cpu):
    """The XLA strategies serve ``bf16-mixed`` themselves; ``"bf16"`` means it, as in the reference."""
    fabric = Fabric(accelerator=xla_cpu, strategy="xla", devices=2, precision="bf16-mixed")
    assert fabric.strategy.precision.precision == "bf16-mixed"
    with pytest.warns(UserWarning, match="bf16"):
        fabric = Fabric(accelerator=xla_cpu, strategy="xla", devices=2, precision="bf16")
    assert fabric.strategy.precision.precision == "bf16-mixed"


# ------------------------------------------------------------------------------------------------ CLI
def test_fabric_run_refuses_the_multi_replica_strategy(tmp_path: Path):
    """``fabric run`` cannot start torch_xla's replicas (its launcher runs a function); one-process XLA runs work."""
    # multiprocess-check: single process (the multi-replica run is refused before any process starts)
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    accelerator = "tpu" if HAS_TORCH_XLA else "cpu"  # the lane has torch_xla and PJRT_DEVICE=CPU
    env = _env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    done = subprocess.run(
        [*fabric_command(), "--accelerator", accelerator, "--strategy", "xla", "--devices", "2", str(script)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "starts its processes itself and runs a function in them ('xla' launcher)" in done.stderr
    assert "ran" not in done.stdout
