"""The binding step (issue 27, "resolve once, build complete"): the resolver decides everything, then hands it to
the strategy at once; after that its precision and launcher are read-only. ``fabric run`` decides the strategy with
the same public function, and its options are declared once. ``require_precision_type`` is the one refusal a
strategy that owns its precision type uses."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
from typing import Any

import pytest
import torch
from torch.distributed.run import get_args_parser

from fabric_core import Fabric, cli_run, connector
from fabric_core.accelerators.cpu import CPUAccelerator
from fabric_core.plugins import build_registry, get_registry, hookimpl, reset_registry, set_registry
from fabric_core.precision.base import Precision
from fabric_core.precision.double import DoublePrecision
from fabric_core.precision.full import FullPrecision
from fabric_core.precision.half import HalfPrecision
from fabric_core.strategies.base import Strategy, require_precision_type
from fabric_core.strategies.single_device import SingleDeviceStrategy


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch):
    """No ``fabric run`` settings before a test, and none left after it (``prepare_environment`` sets them)."""
    for var in (connector.CLI_FLAG, *connector.CLI_SETTINGS.values(), "OMP_NUM_THREADS", "FABRIC_HANG_TIMEOUT"):
        monkeypatch.setenv(var, "")  # recorded, so monkeypatch restores the original state afterwards
        monkeypatch.delenv(var)
    reset_registry()
    yield
    reset_registry()


needs_ddp = pytest.mark.skipif(
    importlib.util.find_spec("fabric_ddp") is None, reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)"
)

# ------------------------------------------------------------------------------------------------ binding
@needs_ddp
def test_precision_and_launcher_are_read_only_once_bound():
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    strategy = fabric.strategy
    assert strategy.bound and strategy.launcher is not None
    with pytest.raises(AttributeError, match=r"`DDPStrategy.precision` is read-only .* `Fabric\(precision=...\)`"):
        strategy.precision = DoublePrecision()
    with pytest.raises(AttributeError, match=r"`DDPStrategy.launcher` is read-only .* `fabric_select_launcher`"):
        strategy.launcher = None
    assert type(strategy.precision) is not DoublePrecision and strategy.launcher is not None


def test_a_strategy_built_by_the_user_can_be_changed_until_it_is_passed_to_fabric():
    strategy = SingleDeviceStrategy(device="cpu")
    assert not strategy.bound
    double = DoublePrecision()
    strategy.precision = double  # the reference's setter, before Fabric takes the object
    strategy.launcher = None
    fabric = Fabric(strategy=strategy)
    assert fabric.strategy is strategy and strategy.precision is double and strategy.bound
    model = fabric.setup(torch.nn.Linear(2, 1))
    assert model.weight.dtype == torch.float64
    with pytest.raises(AttributeError, match="read-only"):
        strategy.precision = Precision()


class _LauncherWitness:
    """Answers ``fabric_select_launcher`` first and records what the strategy holds when it is asked."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    @hookimpl(tryfirst=True)
    def fabric_select_launcher(self, strategy: Strategy) -> None:
        self.seen.append(
            {
                "precision": strategy.configured_precision,
                "accelerator": strategy.accelerator,
                "devices": strategy.parallel_devices,
                "environment": strategy.cluster_environment,
                "bound": strategy.bound,
            }
        )
        return None  # the core's default decides


@needs_ddp
def test_the_launcher_is_asked_last_with_the_strategy_complete():
    witness = _LauncherWitness()
    set_registry(build_registry(extra_plugins=(witness,)))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, precision="64-true")
    (seen,) = witness.seen  # asked once
    assert seen["precision"] is fabric.strategy.precision and isinstance(seen["precision"], DoublePrecision)
    assert isinstance(seen["accelerator"], CPUAccelerator)
    assert seen["devices"] == [torch.device("cpu")] * 2 and seen["environment"] is fabric.strategy.cluster_environment
    assert not seen["bound"]  # still inside the binding step: nothing is read-only yet
    assert fabric.strategy.bound


def test_the_connector_completes_a_strategy_only_through_bind():
    """No ``strategy.attach(...)``, ``strategy.precision = ...`` or ``strategy.launcher = ...`` in the connector."""
    tree = ast.parse(inspect.getsource(connector))
    assigned = {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    }
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not assigned & {"precision", "launcher", "cluster_environment", "checkpoint_io", "accelerator"}
    assert "bind" in called and "attach" not in called


# ------------------------------------------------------------------------------------------------ fabric run
@pytest.mark.parametrize(("strategy", "devices"), [("auto", "1"), ("auto", "2"), ("ddp", "2"), ("dp", "2"), ("ddp_spawn", "2")])
def test_fabric_run_and_fabric_resolve_the_same_strategy(strategy: str, devices: str):
    if devices != "1" and importlib.util.find_spec("fabric_ddp") is None:
        pytest.skip("needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    registry = get_registry()
    count = len(CPUAccelerator().parse_devices(devices))
    decided = connector.resolve_strategy(registry, strategy, CPUAccelerator(), count, 1, interactive=False)
    built = Fabric(accelerator="cpu", strategy=strategy, devices=int(devices)).strategy
    assert type(decided) is type(built) and decided.launcher_name == built.launcher_name
    if decided.launcher_name is not None and registry.get("launcher", decided.launcher_name).load().requires_function:
        with pytest.raises(cli_run.CLIError, match="starts its processes itself"):
            cli_run.processes_per_node("cpu", strategy, devices)
    else:
        assert cli_run.processes_per_node("cpu", strategy, devices)[0] == (count if decided.launcher_name else 1)


def test_fabric_run_uses_only_public_names_of_the_connector():
    tree = ast.parse(inspect.getsource(cli_run))
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "fabric_core.connector"
        for alias in node.names
    ]
    assert "resolve_strategy" in imported and not [name for name in imported if name.startswith("_")]


def test_each_fabric_run_option_is_declared_once_and_forwarded_from_its_declaration():
    fields = {f.name: f.default for f in dataclasses.fields(cli_run.RunArgs)}
    assert fields.pop("script") == "" and "script_args" in fields and "launcher_options" in fields
    # SCRIPT's own arguments and a script launcher's `--NAME-KEY VALUE` options are not options of `fabric run`
    del fields["script_args"], fields["launcher_options"]
    assert fields == {option.dest: option.default for option in cli_run.ALL_OPTIONS}
    for option in cli_run.ELASTIC_OPTIONS:
        if option.forward != "given":
            continue
        value = "0" if option.dest in ("redirects", "tee", "local_ranks_filter") else "x1"
        line = cli_run.torchrun_arguments(cli_run.parse_run_args([option.flags[-1], value, "train.py"]), 2)
        assert f"{option.torchrun}={value}" in line
        parsed = get_args_parser().parse_args(line)  # torchrun itself knows the flag
        assert str(getattr(parsed, option.dest)) == value
    settings = cli_run.prepare_environment(
        cli_run.parse_run_args(["--accelerator", "cpu", "--precision", "64-true", "train.py"]), 1, "1"
    )
    assert {key for key, var in connector.CLI_SETTINGS.items() if var in settings} == {
        option.dest for option in cli_run.ALL_OPTIONS if option.fabric_setting
    } - {"strategy"}


# ------------------------------------------------------------------------------------------------ process-group keywords
def test_the_process_group_keywords_are_declared_once():
    from fabric_core.strategies.parallel import ParallelOptions, ParallelStrategy, split_parallel_options

    assert list(inspect.signature(ParallelStrategy.__init__).parameters)[1:] == list(ParallelOptions.__annotations__)
    options, rest = split_parallel_options({"timeout": None, "start_method": "spawn", "static_graph": True})
    assert options == {"timeout": None, "start_method": "spawn"} and rest == {"static_graph": True}


# ------------------------------------------------------------------------------------------------ precision type
class Float8Precision(Precision):
    """A precision type that only its own strategy can drive (as a float8 plugin's would be)."""

    def __init__(self, precision: str = "float8") -> None:
        self.precision = precision


class Float8Strategy(SingleDeviceStrategy):
    def check_precision(self, precision: Precision | None) -> None:
        require_precision_type(
            precision,
            strategy="Float8",
            name="float8",
            needs=Float8Precision,
            supported=("float8", "bf16-true"),
            reason="Its kernels cast the weights themselves.",
            also_accepted=(Precision, FullPrecision),
        )


def test_a_strategy_that_owns_its_precision_type_refuses_others_naming_both():
    strategy = "The Float8 strategy can only work with the `Float8Precision` plugin, found"
    with pytest.raises(TypeError, match=strategy) as err:
        Float8Strategy(precision=HalfPrecision("bf16-true"))
    message = str(err.value)
    assert "HalfPrecision" in message and "Its kernels cast the weights themselves." in message
    package = Float8Precision.__module__.split(".")[0]
    assert f"Pass `Float8Precision('bf16-true')` (from {package}) or the name," in message
    assert "`Fabric(strategy='float8', precision='bf16-true')`" in message
    with pytest.raises(TypeError, match=r"Pass one of \('float8', 'bf16-true'\) as `precision=`, or a `Float8Precision`"):
        Float8Strategy(precision=DoublePrecision())  # a subclass of an accepted type is not that type
    with pytest.raises(TypeError, match=strategy):
        Fabric(strategy=Float8Strategy(), plugins=[HalfPrecision("16-true")])
    unbound = Float8Strategy()
    with pytest.raises(TypeError, match=strategy):
        unbound.precision = HalfPrecision("bf16-true")
    own = Float8Precision()
    assert Fabric(strategy=Float8Strategy(precision=own)).strategy.precision is own
    assert type(Fabric(strategy=Float8Strategy()).strategy.precision) is FullPrecision  # an exact type accepted
    require_precision_type(None, strategy="x", name="x", needs=Float8Precision, supported=(), reason="")  # nothing set
