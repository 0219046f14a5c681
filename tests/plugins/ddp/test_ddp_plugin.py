"""fabric-ddp without starting processes: registration, selection, launchers, the `fabric run` command line.

The multi-process behaviour is in ``test_ddp_processes.py`` and ``test_ddp_failures.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from datetime import timedelta

import pytest
import torch
from jobs import free_port

from fabric_core import Fabric, cli_run
from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.accelerators.mps import MPSAccelerator
from fabric_core.environments.plain import PlainEnvironment
from fabric_core.launchers.multiprocessing import MultiProcessingLauncher
from fabric_core.launchers.subprocess_script import SubprocessScriptLauncher, script_command
from fabric_core.plugins import get_registry
from fabric_core.precision import Precision
from fabric_core.strategies import Binding
from fabric_ddp import register
from fabric_ddp.register import DP_ON_CPU_WARNING
from fabric_ddp.strategy import DataParallelStrategy, DDPStrategy

DDP_NAMES = [
    "ddp",
    "ddp_spawn",
    "ddp_fork",
    "ddp_notebook",
    "ddp_find_unused_parameters_true",
    "ddp_find_unused_parameters_false",
    "dp",
]


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch: pytest.MonkeyPatch):
    """Construct Fabric as a user's fresh process would: not under a launcher, not under the CLI."""
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in os.environ if v.startswith(("FABRIC_", "TORCHELASTIC_", "SLURM_"))]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)


# ------------------------------------------------------------------------------------------------ registration


def test_names_are_registered_by_the_distribution():
    registry = get_registry()
    for name in DDP_NAMES:
        entry = registry.get("strategy", name)
        assert entry.distribution == "fabric-ddp"
        assert entry.target in ("fabric_ddp.strategy:DDPStrategy", "fabric_ddp.strategy:DataParallelStrategy")
    assert registry.get("strategy", "ddp_spawn").init_kwargs == {"start_method": "spawn"}
    assert registry.get("strategy", "ddp_notebook").init_kwargs == {"start_method": "fork"}


def test_registration_imports_no_torch():
    """Listing names must stay cheap: the registration module imports neither torch nor the strategies."""
    code = (
        "import sys; import fabric_ddp.register, fabric_ddp;"
        " print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fabric_ddp.strategy')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("devices", "num_nodes", "interactive", "expected"),
    [(2, 1, False, "ddp"), (2, 1, True, "ddp_fork"), (1, 2, True, "ddp"), (1, 1, False, None)],
)
def test_auto_strategy_hook(devices, num_nodes, interactive, expected):
    answer = register.fabric_auto_strategy(
        registry=get_registry(), accelerator=CPUAccelerator(), num_devices=devices, num_nodes=num_nodes,
        interactive=interactive,
    )  # fmt: skip
    assert answer == expected


def test_auto_strategy_leaves_other_accelerators_alone():
    other = types.SimpleNamespace(device_type="xla")
    assert register.fabric_auto_strategy(get_registry(), other, 8, 1, False) is None


# ------------------------------------------------------------------------------------------------ resolution


def test_auto_with_two_cpu_devices_is_ddp_with_subprocess_launcher():
    fabric = Fabric(accelerator="cpu", devices=2)
    strategy = fabric.strategy
    assert isinstance(strategy, DDPStrategy) and strategy.start_method == "popen"
    assert isinstance(strategy.launcher, SubprocessScriptLauncher)
    assert isinstance(strategy.cluster_environment, PlainEnvironment)
    assert fabric.world_size == 2 and fabric.global_rank == 0 and fabric.device == torch.device("cpu")
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert not torch.distributed.is_initialized()  # nothing happens before launch()
    with pytest.raises(RuntimeError, match="must call `.launch"):
        fabric.barrier()


def test_spawn_needs_a_function():
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    launcher = fabric.strategy.launcher
    assert isinstance(launcher, MultiProcessingLauncher) and launcher.start_method == "spawn"
    assert launcher.requires_function and not launcher.is_interactive_compatible
    with pytest.raises(TypeError, match="needs to be called with a function"):
        fabric.launch()


def test_find_unused_parameters_and_kwargs_reach_ddp():
    assert Fabric(
        accelerator="cpu", strategy="ddp_find_unused_parameters_true", devices=2
    ).strategy.ddp_kwargs == {"find_unused_parameters": True}
    strategy = DDPStrategy(static_graph=True, timeout=timedelta(seconds=42))
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    assert (
        fabric.strategy.ddp_kwargs == {"static_graph": True} and fabric.strategy.timeout.total_seconds() == 42
    )


def test_dp_on_cpu_falls_back_to_ddp():
    with pytest.warns(UserWarning, match="'dp' is not supported on CPUs, hence setting `strategy='ddp'`"):
        fabric = Fabric(accelerator="cpu", strategy="dp", devices=2)
    assert type(fabric.strategy) is DDPStrategy
    assert isinstance(fabric.strategy.launcher, SubprocessScriptLauncher)
    assert fabric.world_size == 2 and DP_ON_CPU_WARNING.startswith("'dp'")


def test_interactive_sessions_need_a_fork_launcher(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    with pytest.raises(RuntimeError, match="not compatible with an interactive environment") as err:
        Fabric(accelerator="cpu", strategy="ddp", devices=2)
    # The reference's sentence, naming the strategy `strategy="auto"` picks in a notebook.
    assert "Run your code as a script, or choose one of the compatible strategies: `Fabric(strategy='ddp_fork')`" in str(err.value)
    notebook = Fabric(accelerator="cpu", strategy="ddp_notebook", devices=2)
    assert notebook.strategy.launcher.is_interactive_compatible
    assert Fabric(accelerator="cpu", devices=2).strategy.start_method == "fork"  # auto picks ddp_fork


def test_data_parallel_object_refuses_the_cpu():
    with pytest.raises(ValueError, match="cannot run on the CPU"):
        Fabric(accelerator="cpu", strategy=DataParallelStrategy(), devices=2)


def test_ddp_family_rejects_mps():
    for strategy in (DDPStrategy(), DataParallelStrategy()):
        with pytest.raises(ValueError, match="not supported on the MPS accelerator"):
            strategy.attach(
                Binding(
                    accelerator=MPSAccelerator(),
                    devices=[],
                    num_nodes=1,
                    cluster_environment=None,
                    checkpoint_io=None,
                    precision=Precision(),
                    select_launcher=lambda strategy: None,
                )
            )


def test_unavailable_start_method_is_a_value_error():
    with pytest.raises(ValueError, match="not available on this platform"):
        MultiProcessingLauncher(DDPStrategy(), start_method="teleport")


# ------------------------------------------------------------------------------------------------ launchers


def test_children_get_rendezvous_and_thread_settings(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    fabric = Fabric(accelerator="cpu", devices=3, num_nodes=2)
    launcher = fabric.strategy.launcher
    env = fabric.strategy.cluster_environment
    first, second = (launcher.child_environment(env, rank) for rank in (1, 2))
    assert (first["LOCAL_RANK"], second["LOCAL_RANK"]) == ("1", "2")
    assert (first["RANK"], second["RANK"]) == ("4", "5")  # node 1 holds ranks 3, 4, 5
    assert first["NODE_RANK"] == "1" and first["WORLD_SIZE"] == "6" and first["FABRIC_LAUNCHER_CHILD"] == "1"
    assert first["MASTER_PORT"] == second["MASTER_PORT"] == str(env.main_port)  # picked once
    assert first["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launcher.child_environment(env, 1)["OMP_NUM_THREADS"] == "5"


def test_script_command_reruns_script_or_module(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    main = types.ModuleType("__main__")
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    command = script_command()
    assert command[0] == sys.executable and command[-3:] == [str(script), "--lr", "0.1"]

    main.__spec__ = types.SimpleNamespace(name="mypkg.train")
    command = script_command()
    assert command[-4:] == ["-m", "mypkg.train", "--lr", "0.1"]

    main.__spec__ = None
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(RuntimeError, match="not started from a script file"):
        script_command()


def test_ddp_wrapping_in_a_single_process_group(monkeypatch):
    """World size 1 is enough to see the wrapper, its removal and the no_backward_sync contract."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=1)
    strategy = fabric.strategy
    try:
        strategy.setup_environment()
        module = torch.nn.Linear(2, 2)
        wrapped = strategy.setup_module(module)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert strategy.unwrap_module(wrapped) is module
        assert list(strategy.get_module_state_dict(wrapped)) == ["weight", "bias"]  # no "module." prefix
        with strategy.backward_sync_control.no_backward_sync(wrapped, enabled=True):
            assert not wrapped.require_backward_grad_sync
        assert wrapped.require_backward_grad_sync
        with pytest.raises(TypeError, match="wrapped in `DistributedDataParallel`"):
            strategy.backward_sync_control.no_backward_sync(module, enabled=True)
    finally:
        strategy.teardown()
    assert not torch.distributed.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dp_on_cuda_is_one_process():
    fabric = Fabric(accelerator="cuda", strategy="dp", devices=1)
    assert type(fabric.strategy) is DataParallelStrategy
    assert fabric.strategy.launcher is None and fabric.world_size == 1
    model = fabric.setup(torch.nn.Linear(2, 2))
    assert isinstance(model._forward_module, torch.nn.DataParallel)
    assert model(torch.ones(3, 2, device=fabric.device)).shape == (3, 2)
    assert cli_run.processes_per_node("cuda", "dp", "1") == (1, "1")


# ------------------------------------------------------------------------------------------------ fabric run


def test_cli_refuses_strategies_whose_launcher_needs_a_function(tmp_path, capsys):
    """Decided from the classes: spawn/fork launchers run a function, so `fabric run` cannot start them."""
    for name in ("ddp_spawn", "ddp_fork", "ddp_notebook"):
        with pytest.raises(cli_run.CLIError, match=f"strategy '{name}' starts its processes itself"):
            cli_run.processes_per_node("cpu", name, "2")
    for name in ("ddp", "dp", "ddp_find_unused_parameters_true"):
        assert cli_run.processes_per_node("cpu", name, "2") == (2, "2")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')")
    assert cli_run.main(["--strategy", "ddp_spawn", str(script)]) == 2
    assert "`fabric run` cannot start it" in capsys.readouterr().err


def test_cli_arguments_reach_torchrun_and_the_environment(monkeypatch):
    for var in ("OMP_NUM_THREADS", "FABRIC_CLI_USED", "FABRIC_DEVICES", "FABRIC_NUM_NODES", "FABRIC_STRATEGY",
                "FABRIC_PRECISION", "FABRIC_ACCELERATOR"):  # fmt: skip
        monkeypatch.setenv(var, "")  # so that monkeypatch restores the original state afterwards
        monkeypatch.delenv(var)
    args = cli_run.parse_run_args(
        ["--devices", "2", "--num_nodes", "3", "--node-rank", "1", "--main-address", "10.0.0.1",
         "--main_port", "1234", "--strategy", "ddp", "--precision", "64-true", "train.py", "--lr", "0.1", "-m"]
    )  # fmt: skip
    assert args.script == "train.py" and args.script_args == ["--lr", "0.1", "-m"]
    nprocs, devices = cli_run.processes_per_node(args.accelerator, args.strategy, args.devices)
    assert (nprocs, devices) == (2, "2")
    assert cli_run.torchrun_arguments(args, nprocs) == [
        "--nproc-per-node=2", "--nnodes=3", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=1234",
        "--monitor-interval=0.1", "--max-restarts=0", "train.py", "--lr", "0.1", "-m",
    ]  # fmt: skip
    cli_run.prepare_environment(args, nprocs, devices)
    assert os.environ["FABRIC_CLI_USED"] == "1" and os.environ["FABRIC_DEVICES"] == "2"
    assert os.environ["FABRIC_NUM_NODES"] == "3" and os.environ["FABRIC_STRATEGY"] == "ddp"
    assert os.environ["FABRIC_PRECISION"] == "64-true" and "FABRIC_ACCELERATOR" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))

    module_args = cli_run.parse_run_args(["-m", "pkg.train", "--epochs", "1"])
    assert cli_run.torchrun_arguments(module_args, 1)[-4:] == ["-m", "pkg.train", "--epochs", "1"]


def test_cli_processes_per_node():
    assert cli_run.processes_per_node("cpu", None, "3") == (3, "3")
    assert cli_run.processes_per_node(None, None, "auto") == (1, "auto")  # each process resolves "auto" itself
    assert cli_run.processes_per_node("cpu", "dp", "4") == (4, "4")  # on CPU, dp becomes ddp
    # fabric-xla installed: no TPU here; not installed: the install hint. Never a silent process count.
    with pytest.raises(cli_run.CLIError, match="not available|pip install fabric-xla|FABRIC_PLUGINS"):
        cli_run.processes_per_node("tpu", None, "8")
    with pytest.raises(cli_run.CLIError, match=r"`Fabric\(devices='0'\)` value is not a valid input using cpu accelerator"):
        cli_run.processes_per_node("cpu", None, "0")
    # devices 0 is refused before the accelerator is resolved (an unavailable one would hide the real mistake)
    with pytest.raises(cli_run.CLIError, match="value is not a valid input using tpu accelerator"):
        cli_run.processes_per_node("tpu", None, "0")


def test_cli_rejects_bad_input_before_starting_anything(tmp_path, capsys):
    missing = cli_run.parse_run_args([str(tmp_path / "missing.py")])
    assert cli_run.run_main(missing) == 2
    assert "does not exist" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')")
    bad_rank = cli_run.parse_run_args(["--num-nodes", "2", "--node-rank", "2", str(script)])
    assert cli_run.run_main(bad_rank) == 2
    assert "--node-rank" in capsys.readouterr().err
