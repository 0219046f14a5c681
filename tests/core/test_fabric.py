"""The single-process ``Fabric`` facade, checked against the behaviour the seeds and the reference describe.

Every test runs with plugin autoloading switched off and a fresh registry, so the results do not depend on
which plugin distributions (fabric-ddp, fabric-amp, ...) happen to be installed in the venv.
"""

from __future__ import annotations

import os
import pickle
import warnings
from contextlib import nullcontext
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fabric_core import Fabric, is_wrapped, seed_everything
from fabric_core.accelerators import CPUAccelerator
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_core.loggers import CSVLogger
from fabric_core.loggers.base import Logger
from fabric_core.plugins import reset_registry
from fabric_core.precision import DoublePrecision, Precision
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_core.utilities.init import SkipParameterInit
from fabric_core.utilities.rank_zero import PossibleUserWarning, set_rank
from fabric_core.utilities.seed import worker_init_function
from fabric_core.wrappers import FabricDataLoader, FabricModule, FabricOptimizer, _compile_kwargs_from_dynamo

_FABRIC_ENV = (
    "FABRIC_PLUGINS",
    "FABRIC_CLI_USED",
    "FABRIC_ACCELERATOR",
    "FABRIC_STRATEGY",
    "FABRIC_DEVICES",
    "FABRIC_NUM_NODES",
    "FABRIC_PRECISION",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    """Core built-ins only, a fresh registry, rank 0, and the environment restored afterwards."""
    saved_env = dict(os.environ)
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in _FABRIC_ENV:
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    dtype = torch.get_default_dtype()
    yield
    reset_registry()
    set_rank(0)
    os.environ.clear()
    os.environ.update(saved_env)
    assert torch.get_default_dtype() == dtype, "a context leaked its default dtype"


def model_and_optimizer(lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


class CustomState:
    """A trusted, non-tensor object: the safe loader refuses it."""

    def __init__(self, value: int) -> None:
        self.value = value


class RecordingLogger(Logger):
    """A real logger that keeps what it received."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append({"metrics": dict(metrics), "step": step})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class LocalRankOneStrategy(SingleDeviceStrategy):
    """A single-device strategy that pretends to be the second process of a node."""

    @property
    def local_rank(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 1


class RecordingStrategy(SingleDeviceStrategy):
    """Records which modules the facade asks it to move."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved: list[nn.Module] = []

    def module_to_device(self, module: nn.Module) -> None:
        self.moved.append(module)
        super().module_to_device(module)


# ---------------------------------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(("name", "suggestion"), [("cpux", "cpu"), ("cdua", "cuda"), ("mpss", "mps")])
def test_invalid_accelerator_name_lists_names_and_suggests_closest(name, suggestion):
    with pytest.raises(ValueError, match="You selected an invalid accelerator name") as err:
        Fabric(accelerator=name)
    message = str(err.value)
    assert f"Did you mean {suggestion!r}?" in message
    assert "Available names are: auto, cpu, cuda, mps" in message


def test_invalid_strategy_name_suggests_closest():
    with pytest.raises(ValueError, match="You selected an invalid strategy name: `strategy='single_devise'`") as err:
        Fabric(strategy="single_devise")
    assert "Did you mean 'single_device'?" in str(err.value)
    assert "single_device" in str(err.value).split("Available names are:")[1]


@pytest.mark.parametrize(
    ("strategy", "dist"),
    [
        ("ddp", "fabric-ddp"),
        ("DDP", "fabric-ddp"),
        ("ddp_spawn", "fabric-ddp"),
        ("dp", "fabric-ddp"),
        ("fsdp", "fabric-fsdp"),
        ("deepspeed_stage_3_offload", "fabric-deepspeed"),
        ("xla", "fabric-xla"),
    ],
)
def test_strategy_of_a_missing_distribution_says_what_to_install(strategy, dist, install_hint):
    with pytest.raises(ValueError, match=install_hint(dist)):
        Fabric(strategy=strategy)


def test_accelerator_of_a_missing_distribution_says_what_to_install(install_hint):
    with pytest.raises(ValueError, match=install_hint("fabric-xla")):
        Fabric(accelerator="tpu")


@pytest.mark.parametrize("precision", [12, 1, "invalid", "32-mixed", "bf32"])
def test_invalid_precision(precision):
    with pytest.raises(ValueError, match=f"Precision {precision!r} is invalid. Allowed precision values: \\("):
        Fabric(precision=precision)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", 16, "16", "bf16"])
def test_mixed_precision_without_fabric_amp_says_what_to_install(precision, install_hint):
    with pytest.raises(ValueError, match=install_hint("fabric-amp")):
        Fabric(precision=precision)


@pytest.mark.parametrize(
    ("precision", "canonical", "cls"),
    [
        (None, "32-true", Precision),
        (32, "32-true", Precision),
        ("32", "32-true", Precision),
        ("32-true", "32-true", Precision),
        (64, "64-true", DoublePrecision),
        ("64", "64-true", DoublePrecision),
        ("64-true", "64-true", DoublePrecision),
    ],
)
def test_precision_aliases_convert_silently(precision, canonical, cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric = Fabric(precision=precision)
    assert isinstance(fabric.strategy.precision, cls)
    assert fabric.strategy.precision.precision == canonical


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, "2", True, None])
def test_num_nodes_must_be_a_positive_int(num_nodes):
    with pytest.raises(ValueError, match="`num_nodes` must be a positive integer, but got"):
        Fabric(num_nodes=num_nodes)


@pytest.mark.parametrize("devices", [0, "0", []])
def test_zero_devices_are_invalid(devices):
    with pytest.raises(ValueError, match="value is not a valid input using cpu accelerator"):
        Fabric(accelerator="cpu", devices=devices)


@pytest.mark.parametrize("devices", [-1, "-1", [0], [0, 1], None, "two"])
def test_cpu_devices_must_be_a_count(devices):
    with pytest.raises(TypeError, match="`devices` selected with `CPUAccelerator` should be an int > 0."):
        Fabric(accelerator="cpu", devices=devices)


@pytest.mark.parametrize("devices", [1, "1", " 1 ", "auto"])
def test_one_cpu_device(devices):
    fabric = Fabric(accelerator="cpu", devices=devices)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert fabric.world_size == 1
    assert fabric.device == torch.device("cpu")


@pytest.mark.parametrize("devices", [2, "2"])
def test_several_cpu_devices_need_a_parallel_strategy_plugin(devices, install_hint):
    # "2" is parsed as two processes; without fabric-ddp no installed strategy can run them.
    with pytest.raises(ValueError, match="2 device\\(s\\).*" + install_hint("fabric-ddp")):
        Fabric(accelerator="cpu", devices=devices)


def test_plugins_validation():
    with pytest.raises(ValueError, match="Received both `precision=64-true` and `plugins="):
        Fabric(precision="64-true", plugins=DoublePrecision())
    with pytest.raises(ValueError, match="Received multiple values for Precision flags in `plugins`"):
        Fabric(plugins=[DoublePrecision(), Precision()])
    with pytest.raises(TypeError, match="Found invalid type for plugin 'x'. Expected one of: Precision"):
        Fabric(plugins=["x"])
    with pytest.raises(TypeError, match="Found invalid type for plugin"):
        Fabric(plugins=SingleDeviceStrategy())
    io = TorchCheckpointIO()
    precision = DoublePrecision()
    fabric = Fabric(plugins=[precision, io])
    assert fabric.strategy.precision is precision
    assert fabric.strategy.checkpoint_io is io
    single = Fabric(plugins=precision)
    assert single.strategy.precision is precision


def test_strategy_instance_conflicts():
    with pytest.raises(ValueError, match="accelerator set through both"):
        Fabric(strategy=SingleDeviceStrategy(accelerator=CPUAccelerator()), accelerator="cpu")
    with pytest.raises(ValueError, match="precision set through both"):
        Fabric(strategy=SingleDeviceStrategy(precision=DoublePrecision()), plugins=DoublePrecision())
    with pytest.raises(ValueError, match="checkpoint_io set through both"):
        Fabric(strategy=SingleDeviceStrategy(checkpoint_io=TorchCheckpointIO()), plugins=TorchCheckpointIO())
    # A `precision=` flag the strategy's own precision would silently override is refused ...
    with pytest.raises(ValueError, match="precision set through both the strategy object"):
        Fabric(strategy=SingleDeviceStrategy(precision=DoublePrecision()), precision="bf16-true")
    # ... one that agrees with it is fine, and so is the strategy's own accelerator.
    precision = DoublePrecision()
    accelerator = CPUAccelerator()
    fabric = Fabric(strategy=SingleDeviceStrategy(accelerator=accelerator, precision=precision), precision=64)
    assert fabric.strategy.precision is precision
    assert fabric.accelerator is accelerator


def test_strategy_and_accelerator_instances():
    strategy = SingleDeviceStrategy(device="cpu")
    accelerator = CPUAccelerator()
    fabric = Fabric(strategy=strategy, accelerator=accelerator)
    assert fabric.strategy is strategy
    assert fabric.accelerator is accelerator
    assert strategy.accelerator is accelerator


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_unavailable_accelerators():
    with pytest.raises(RuntimeError, match="`CUDAAccelerator` can not run on your system since the accelerator is"):
        Fabric(accelerator="cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(RuntimeError, match="No supported gpu backend found!"):
            Fabric(accelerator="gpu")


def test_constructor_writes_no_environment_variables():
    before = dict(os.environ)
    fabric = Fabric(precision="64-true", callbacks=[object()], loggers=[RecordingLogger()])
    fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    assert dict(os.environ) == before


# ---------------------------------------------------------------------------------------------------- properties


def test_properties_single_device():
    fabric = Fabric()
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert fabric.device == torch.device("cpu")
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (0, 0, 0, 1)
    assert fabric.is_global_zero is True
    assert fabric.loggers == []
    with pytest.raises(IndexError):
        _ = fabric.logger


def test_loggers_and_callbacks_become_lists():
    logger = RecordingLogger()
    callback = object()
    fabric = Fabric(loggers=logger, callbacks=callback)
    assert fabric.loggers == [logger]
    assert fabric.logger is logger
    assert fabric._callbacks == [callback]
    other = RecordingLogger()
    fabric = Fabric(loggers=[logger, other])
    assert fabric.loggers == [logger, other]
    assert fabric.logger is logger


def test_strategy_ranks_drive_properties():
    fabric = Fabric(strategy=LocalRankOneStrategy())
    assert fabric.local_rank == 1
    assert fabric.global_rank == 1
    assert fabric.is_global_zero is False


# ---------------------------------------------------------------------------------------------------- launch / run


def test_launch_without_function():
    fabric = Fabric()
    assert fabric._launched is False
    assert fabric.launch() is None
    assert fabric._launched is True


def test_launch_with_function_passes_fabric_and_returns_result():
    fabric = Fabric()
    seen = []

    def work(f, a, b=0):
        seen.append(f)
        return a + b

    assert fabric.launch(work, 1, b=2) == 3
    assert seen == [fabric]


def test_launch_rejects_bad_functions():
    fabric = Fabric()

    def no_args():
        return 1

    with pytest.raises(TypeError, match="needs to be a callable.*HINT: do `.launch\\(your_fn\\)`"):
        fabric.launch(no_args())
    with pytest.raises(TypeError, match="needs to take at least one argument. The launcher will pass in the `Fabric`"):
        fabric.launch(no_args)
    assert fabric._launched is False


def test_launch_under_the_cli_is_refused(monkeypatch):
    monkeypatch.setenv("FABRIC_CLI_USED", "1")
    fabric = Fabric()
    assert fabric._launched is True  # the CLI created the processes: nothing left to launch
    with pytest.raises(RuntimeError, match="launched through the CLI.*Calling  `.launch\\(\\)` again is not allowed"):
        fabric.launch()
    with pytest.raises(RuntimeError, match="again is not allowed"):
        fabric.launch(lambda f: None)


class RunFabric(Fabric):
    def run(self, a, b=0):
        return self._launched, a, b


def test_run_override_launches_and_returns():
    fabric = RunFabric()
    assert fabric.run(1, b=2) == (True, 1, 2)


def test_run_override_under_the_cli_is_refused(monkeypatch):
    monkeypatch.setenv("FABRIC_CLI_USED", "1")
    with pytest.raises(TypeError, match="Overriding `Fabric.run\\(\\)` and launching from the CLI is not allowed"):
        RunFabric()


# ---------------------------------------------------------------------------------------------------- setup


def test_setup_return_shapes():
    fabric = Fabric()
    model = fabric.setup(nn.Linear(2, 2))
    assert isinstance(model, FabricModule)

    module, optimizer = model_and_optimizer()
    out = fabric.setup(module, optimizer)
    assert isinstance(out, tuple) and len(out) == 2
    assert isinstance(out[0], FabricModule) and out[0].module is module
    assert isinstance(out[1], FabricOptimizer) and out[1].optimizer is optimizer

    module = nn.Linear(2, 2)
    opt1 = torch.optim.SGD(module.parameters(), lr=0.1)
    opt2 = torch.optim.Adam(module.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt1, step_size=1)
    m, o1, o2, s = fabric.setup(module, opt1, opt2, scheduler=scheduler)
    assert (o1.optimizer, o2.optimizer) == (opt1, opt2)
    assert s is scheduler  # returned as is, not wrapped

    # A scheduler without optimizers is ignored.
    alone = fabric.setup(nn.Linear(2, 2), scheduler=scheduler)
    assert isinstance(alone, FabricModule)


def test_setup_twice_is_refused():
    fabric = Fabric()
    model, optimizer = fabric.setup(*model_and_optimizer())
    with pytest.raises(ValueError, match="A model should be passed only once to the `setup` method."):
        fabric.setup(model)
    with pytest.raises(ValueError, match="An optimizer should be passed only once to the `setup` method."):
        fabric.setup(nn.Linear(1, 1), optimizer)
    with pytest.raises(ValueError, match="A model should be passed only once to the `setup_module` method."):
        fabric.setup_module(model)
    with pytest.raises(ValueError, match="A model should be passed only once to the `setup` method."):
        fabric.setup(torch.compile(model, backend="eager"))


@pytest.mark.parametrize("move_to_device", [True, False])
def test_setup_moves_the_model_only_when_asked(move_to_device):
    strategy = RecordingStrategy()
    fabric = Fabric(strategy=strategy)
    module, optimizer = model_and_optimizer()
    fabric.setup(module, optimizer, move_to_device=move_to_device)
    other = nn.Linear(1, 1)
    fabric.setup_module(other, move_to_device=move_to_device)
    assert strategy.moved == ([module, other] if move_to_device else [])


def _mixed_device_module() -> nn.Module:
    module = nn.Module()
    module.a = nn.Parameter(torch.ones(1))
    module.b = nn.Parameter(torch.ones(1))
    module.c = nn.Parameter(torch.empty(1, device="meta"))
    module.d = nn.Parameter(torch.empty(1, device="meta"))
    return module


def test_setup_warns_about_parameters_on_different_devices():
    fabric = Fabric()
    with pytest.warns(
        PossibleUserWarning,
        match="has 2 parameters on different devices \\(for example 'c' on meta and 'a' on cpu\\). Since"
        " `move_to_device=True`",
    ):
        fabric.setup(_mixed_device_module())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric.setup(_mixed_device_module(), move_to_device=False)
        fabric.setup(nn.Linear(2, 2))


def test_setup_recompiles_a_compiled_module():
    fabric = Fabric()
    module = nn.Linear(3, 2)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    wrapped = fabric.setup(compiled)
    assert is_wrapped(wrapped)
    assert wrapped.module is module  # the user's module, unwrapped ...
    forward_module = wrapped._forward_module
    assert type(forward_module).__name__ == "OptimizedModule"  # ... and compiled again on top of the strategy's
    assert forward_module._orig_mod is module
    assert _compile_kwargs_from_dynamo(forward_module) == {"backend": "eager", "fullgraph": True}
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), module(x))

    # `_reapply_compile=False` keeps the compiled object as the model.
    kept = fabric.setup(torch.compile(nn.Linear(3, 2), backend="eager"), _reapply_compile=False)
    assert type(kept.module).__name__ == "OptimizedModule"
    assert kept._forward_module is kept.module


def test_setup_refuses_a_compiled_module_whose_arguments_are_unknown():
    fabric = Fabric()
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    del compiled.dynamo_ctx  # what a torch version with a different internal layout would look like
    with pytest.raises(RuntimeError, match="Failed to determine the arguments that were used to compile the module"):
        fabric.setup(compiled)
    kept = fabric.setup(compiled, _reapply_compile=False)
    assert kept.module is compiled
    # methods that only need to look through the compiled wrapper do not need its arguments
    compiled_model = torch.compile(fabric.setup(nn.Linear(2, 2)), backend="eager")
    del compiled_model.dynamo_ctx
    assert isinstance(fabric.no_backward_sync(compiled_model), nullcontext)
    assert is_wrapped(compiled_model)
    compiled._fabric_compile_kwargs = {"backend": "eager"}
    assert type(fabric.setup(compiled)._forward_module).__name__ == "OptimizedModule"


def test_on_after_setup_fires_from_setup_only():
    class Callback:
        def __init__(self):
            self.calls = []

        def on_after_setup(self, fabric, module):
            self.calls.append((fabric, module))

    callback = Callback()
    fabric = Fabric(callbacks=callback)
    model = fabric.setup(nn.Linear(1, 1))
    assert callback.calls == [(fabric, model)]
    fabric.setup_module(nn.Linear(1, 1))
    assert len(callback.calls) == 1


def test_setup_module_then_optimizers():
    fabric = Fabric()
    model = fabric.setup_module(nn.Linear(2, 2))
    assert isinstance(model, FabricModule)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = fabric.setup_optimizers(optimizer)
    assert isinstance(wrapped, FabricOptimizer) and isinstance(wrapped, torch.optim.SGD)
    assert wrapped.optimizer is optimizer

    opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
    opt2 = torch.optim.Adam(model.parameters())
    both = fabric.setup_optimizers(opt1, opt2)
    assert isinstance(both, tuple) and [o.optimizer for o in both] == [opt1, opt2]


def test_setup_optimizers_validation():
    fabric = Fabric()
    with pytest.raises(ValueError, match="`setup_optimizers` requires at least one optimizer as input."):
        fabric.setup_optimizers()
    _, optimizer = model_and_optimizer()
    wrapped = fabric.setup_optimizers(optimizer)
    with pytest.raises(ValueError, match="An optimizer should be passed only once to the `setup_optimizers` method."):
        fabric.setup_optimizers(wrapped)

    with torch.device("meta"):
        meta_model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="references to the model's meta-device parameters.*setup_optimizers"):
        fabric.setup_optimizers(torch.optim.SGD(meta_model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="meta-device parameters.*set up the model and optimizer\\(s\\) separately"):
        fabric.setup(nn.Linear(2, 2), torch.optim.SGD(meta_model.parameters(), lr=0.1))


# ---------------------------------------------------------------------------------------------------- dataloaders


class RecordingSampler(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Batch:
    """A custom batch type: ``.to`` records where it was sent."""

    def __init__(self, items: list) -> None:
        self.items = items
        self.moved_to: list[torch.device] = []

    def to(self, device):
        self.moved_to.append(device)
        return self


def test_setup_dataloaders_validation():
    fabric = Fabric()
    loader = DataLoader(TensorDataset(torch.arange(4.0)))
    with pytest.raises(ValueError, match="`setup_dataloaders` requires at least one dataloader as input."):
        fabric.setup_dataloaders()
    with pytest.raises(TypeError, match="Only PyTorch DataLoader are currently supported in `setup_dataloaders`."):
        fabric.setup_dataloaders(range(3))
    with pytest.raises(TypeError, match="Only PyTorch DataLoader"):
        fabric.setup_dataloaders(loader, [1, 2])
    wrapped = fabric.setup_dataloaders(loader)
    with pytest.raises(ValueError, match="A dataloader should be passed only once to the `setup_dataloaders` method."):
        fabric.setup_dataloaders(wrapped)


def test_setup_dataloaders_one_in_one_out_several_in_a_list():
    fabric = Fabric()
    a = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2)
    b = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=3)
    one = fabric.setup_dataloaders(a)
    assert isinstance(one, FabricDataLoader) and one._dataloader is a
    several = fabric.setup_dataloaders(a, b)
    assert isinstance(several, list) and [w._dataloader for w in several] == [a, b]
    assert [len(w) for w in several] == [2, 2]
    # single device: no distributed sampler is injected
    assert several[0].sampler is a.sampler


@pytest.mark.parametrize("move_to_device", [True, False])
def test_setup_dataloaders_moves_batches(move_to_device):
    fabric = Fabric()
    loader = DataLoader(list(range(6)), batch_size=2, collate_fn=Batch)
    wrapped = fabric.setup_dataloaders(loader, move_to_device=move_to_device)
    batches = list(wrapped)
    assert len(batches) == 3
    assert wrapped.device == (torch.device("cpu") if move_to_device else None)
    assert all(b.moved_to == ([torch.device("cpu")] if move_to_device else []) for b in batches)


def test_set_epoch_is_called_once_per_epoch_on_first_next():
    fabric = Fabric()
    sampler = RecordingSampler(4)
    wrapped = fabric.setup_dataloaders(DataLoader(list(range(4)), sampler=sampler, batch_size=2))
    iterator = iter(wrapped)
    assert sampler.epochs == []  # not at iter() time
    next(iterator)
    assert sampler.epochs == [0]
    list(iterator)
    assert [b.tolist() for b in wrapped] == [[0, 1], [2, 3]]
    list(wrapped)
    assert sampler.epochs == [0, 1, 2]


def test_worker_init_fn_added_when_seeding_workers(monkeypatch):
    fabric = Fabric()
    loader = fabric.setup_dataloaders(DataLoader(list(range(4))))
    assert loader.worker_init_fn is None

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    raw = DataLoader(list(range(4)))
    loader = fabric.setup_dataloaders(raw)
    fn = raw.worker_init_fn
    assert isinstance(fn, partial) and fn.func is worker_init_function and fn.keywords == {"rank": 0}
    assert loader.worker_init_fn is fn

    def mine(worker_id):
        pass

    loader = fabric.setup_dataloaders(DataLoader(list(range(4)), worker_init_fn=mine))
    assert loader.worker_init_fn is mine  # the user's own function is kept


def test_seeded_workers_produce_reproducible_distinct_streams():
    class Rand(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.rand(1)

    def draw():
        Fabric.seed_everything(7, verbose=False)
        fabric = Fabric()
        loader = fabric.setup_dataloaders(DataLoader(Rand(), batch_size=1, num_workers=2))
        return torch.cat(list(loader)).flatten()

    first, second = draw(), draw()
    torch.testing.assert_close(first, second)
    assert len(set(first.tolist())) == 4


# ---------------------------------------------------------------------------------------------------- backward / clipping


def test_backward_matches_plain_backward():
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    fabric = Fabric()
    model = fabric.setup(nn.Linear(3, 2))
    model.load_state_dict(reference.state_dict())
    x = torch.randn(5, 3)
    reference(x).pow(2).sum().backward()
    fabric.backward(model(x).pow(2).sum(), model=model)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # extra arguments reach torch's backward
    loss = model(x).sum()
    fabric.backward(loss, retain_graph=True)
    fabric.backward(loss)


def _model_with_grads(fabric: Fabric, scale: float = 100.0):
    torch.manual_seed(1)
    model, optimizer = fabric.setup(*model_and_optimizer())
    fabric.backward(model(torch.randn(8, 3)).pow(2).sum() * scale)
    return model, optimizer


def test_clip_gradients_argument_validation():
    fabric = Fabric()
    model, optimizer = _model_with_grads(fabric)
    with pytest.raises(ValueError, match="Only one of `clip_val` or `max_norm` can be set"):
        fabric.clip_gradients(model, optimizer, clip_val=1.0, max_norm=1.0)
    with pytest.raises(ValueError, match="You have to specify either `clip_val` or `max_norm` to do gradient clipping!"):
        fabric.clip_gradients(model, optimizer)


@pytest.mark.parametrize("norm_type", [2.0, 1, "inf"])
def test_clip_gradients_by_norm_returns_the_norm_before_clipping(norm_type):
    fabric = Fabric()
    model, optimizer = _model_with_grads(fabric)
    grads = [p.grad.clone() for p in model.parameters()]
    order = float(norm_type)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, order) for g in grads]), order)
    assert expected > 1.0
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, order) for p in model.parameters()]), order)
    torch.testing.assert_close(after, torch.tensor(1.0), rtol=1e-4, atol=1e-4)


def test_clip_gradients_nonfinite():
    fabric = Fabric()
    model, optimizer = _model_with_grads(fabric)
    model.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
    assert torch.isnan(fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False))


def test_clip_gradients_by_value():
    fabric = Fabric()
    model, optimizer = _model_with_grads(fabric)
    before = [p.grad.clone() for p in model.parameters()]
    assert max(g.abs().max() for g in before) > 0.5
    assert fabric.clip_gradients(model, optimizer, clip_val=0.5) is None
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g.clamp(-0.5, 0.5))


# ---------------------------------------------------------------------------------------------------- init / autocast


def test_autocast_and_init_contexts_with_64_true():
    fabric = Fabric(precision="64-true")
    with fabric.autocast():
        assert torch.get_default_dtype() == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with fabric.init_tensor():
        floating = torch.empty(2)
        integer = torch.arange(2)
        explicit = torch.zeros(1, dtype=torch.float16)
    assert (floating.dtype, integer.dtype, explicit.dtype) == (torch.float64, torch.int64, torch.float16)
    with fabric.init_module():
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(ZeroDivisionError), fabric.init_module():
        1 / 0  # noqa: B018
    assert torch.get_default_dtype() == torch.float32


def test_contexts_are_no_ops_with_32_true():
    fabric = Fabric()
    with fabric.autocast():
        assert torch.get_default_dtype() == torch.float32
        assert not torch.is_autocast_enabled("cpu")
    with fabric.init_tensor():
        assert torch.empty(1).dtype == torch.float32
    with fabric.init_module():
        assert nn.Linear(1, 1).weight.dtype == torch.float32


def test_init_module_empty_init_skips_parameter_initialisation():
    fabric = Fabric()
    torch.manual_seed(0)
    seeded = nn.Linear(32, 32)

    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        initialised = nn.Linear(32, 32)
    torch.testing.assert_close(initialised.weight, seeded.weight)

    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        empty = nn.Linear(32, 32)
    # no random draw happened: the generator is exactly where manual_seed(0) left it
    after = torch.rand(4)
    torch.manual_seed(0)
    torch.testing.assert_close(after, torch.rand(4))
    assert not torch.equal(empty.weight, seeded.weight)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("uniform_", ()),
        ("normal_", ()),
        ("constant_", (0.5,)),
        ("kaiming_uniform_", ()),
        # plain-Python initialisers that write into the tensor in place
        ("xavier_uniform_", ()),
        ("xavier_normal_", ()),
        ("kaiming_normal_", ()),
        ("trunc_normal_", ()),
        ("ones_", ()),
        ("eye_", ()),
        ("orthogonal_", ()),
        ("sparse_", (0.5,)),
    ],
)
def test_skip_parameter_init_skips_every_initialiser(name, args):
    tensor = torch.full((4, 4), 7.0)
    with SkipParameterInit():
        returned = getattr(torch.nn.init, name)(tensor, *args)
    assert returned is tensor
    assert torch.equal(tensor, torch.full((4, 4), 7.0))
    getattr(torch.nn.init, name)(tensor, *args)  # the mode is gone afterwards
    assert not torch.equal(tensor, torch.full((4, 4), 7.0))


def test_skip_parameter_init_leaves_other_code_alone():
    t = torch.zeros(3, 4)
    with SkipParameterInit():
        torch.nn.init.zeros_(torch.ones(1))
        assert (t + 1).sum() == 12
        t.add_(2)
        t[0, 0] = 5
        layer = nn.LayerNorm(4)  # ones_/zeros_ skipped, the module still builds
    assert t.sum() == 27 and layer.weight.shape == (4,)
    with SkipParameterInit(enabled=False):
        torch.nn.init.ones_(t)
    assert torch.equal(t, torch.ones(3, 4))


def test_empty_init_draws_no_random_numbers_for_attention_layers():
    torch.manual_seed(0)
    with Fabric().init_module(empty_init=True):
        nn.TransformerEncoderLayer(16, 2, 32)  # xavier_uniform_ inside MultiheadAttention
    after = torch.rand(4)
    torch.manual_seed(0)
    torch.testing.assert_close(after, torch.rand(4))


# ---------------------------------------------------------------------------------------------------- data / printing


def test_to_device_on_collections_and_modules():
    fabric = Fabric()
    batch = Batch([1])
    data = {"a": [torch.ones(1), (torch.zeros(2), "text")], "b": batch, "n": 3}
    moved = fabric.to_device(data)
    assert moved["a"][1][1] == "text" and moved["n"] == 3
    assert isinstance(moved["a"][1], tuple)
    assert moved["a"][0].device == torch.device("cpu")
    assert batch.moved_to == [torch.device("cpu")]
    module = nn.Linear(1, 1)
    assert fabric.to_device(module) is module
    tensor = torch.ones(2)
    assert torch.equal(fabric.to_device(tensor), tensor)


def test_print_only_on_local_rank_zero(capsys):
    Fabric().print("hello", 1, sep="-")
    assert capsys.readouterr().out == "hello-1\n"
    Fabric(strategy=LocalRankOneStrategy()).print("hidden")
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------- collectives


def test_collectives_on_one_device():
    fabric = Fabric()
    fabric.barrier()
    fabric.barrier("named")
    obj = {"x": [1, 2]}
    assert fabric.broadcast(obj) is obj
    tensor = torch.arange(6).view(2, 3)
    assert torch.equal(fabric.all_gather(tensor), tensor)  # no new leading dim for world_size 1
    assert fabric.all_gather(tensor).shape == (2, 3)
    assert torch.equal(fabric.all_reduce(tensor, reduce_op="sum"), tensor)


@pytest.mark.parametrize("method", ["all_gather", "all_reduce"])
def test_collectives_convert_python_scalars(method):
    fabric = Fabric()
    op = getattr(fabric, method)
    for value, dtype in [(3, torch.int32), (True, torch.uint8), (1.5, torch.float32)]:
        out = op(value)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.item() == value
    nested = op({"a": 1, "b": [2.0, "keep"], "c": (False,)})
    assert nested["a"].dtype == torch.int32
    assert nested["b"][0].dtype == torch.float32 and nested["b"][1] == "keep"
    assert nested["c"][0].dtype == torch.uint8


def test_rank_zero_first_runs_the_block():
    fabric = Fabric()
    ran = []
    with fabric.rank_zero_first():
        ran.append(1)
    with fabric.rank_zero_first(local=True):
        ran.append(2)
    assert ran == [1, 2]


def test_no_backward_sync():
    fabric = Fabric()
    with pytest.raises(TypeError, match="You need to set up the model first before you can call"):
        fabric.no_backward_sync(nn.Linear(1, 1))
    model = fabric.setup(nn.Linear(2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for enabled in (True, False):
            context = fabric.no_backward_sync(model, enabled=enabled)
            assert isinstance(context, nullcontext)
            with context:
                fabric.backward(model(torch.ones(1, 2)).sum())
        assert isinstance(fabric.no_backward_sync(torch.compile(model, backend="eager")), nullcontext)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 2.0))


def test_no_backward_sync_warns_when_the_strategy_cannot_skip_sync():
    class NoControl(SingleDeviceStrategy):
        @property
        def backward_sync_control(self):
            return None

    fabric = Fabric(strategy=NoControl())
    model = fabric.setup(nn.Linear(1, 1))
    with pytest.warns(PossibleUserWarning, match="`NoControl` does not support skipping the gradient synchronization"):
        context = fabric.no_backward_sync(model)
    assert isinstance(context, nullcontext)


# ---------------------------------------------------------------------------------------------------- checkpoints


def _trained(fabric: Fabric, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(4, 3)).sum())
    optimizer.step()
    return model, optimizer


def test_save_filter_validation(tmp_path):
    fabric = Fabric()
    model, optimizer = _trained(fabric)
    state = {"model": model, "optimizer": optimizer}
    path = tmp_path / "ckpt.pt"
    with pytest.raises(TypeError, match="Filter should be a dictionary, given 'foo'"):
        fabric.save(path, state, filter="foo")
    with pytest.raises(ValueError, match="The filter keys {'asd'} are not present in the state keys"):
        fabric.save(path, state, filter={"asd": lambda k, v: True})
    with pytest.raises(TypeError, match="Expected `fabric.save\\(filter=...\\)` for key 'model' to be a callable, given 'foo'"):
        fabric.save(path, state, filter={"model": "foo"})
    assert not path.exists()


def test_save_unwraps_and_applies_filter(tmp_path):
    fabric = Fabric()
    model, optimizer = _trained(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 7, "meta": {"a": 1, "b": 2}}
    fabric.save(tmp_path / "ckpt.pt", state, filter={"model": lambda k, v: "bias" not in k, "meta": lambda k, v: False}).wait()  # durable at the path before reading it directly
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert set(raw) == {"model", "optimizer", "step"}  # a filter that keeps nothing drops the key
    assert list(raw["model"]) == ["weight"]  # no wrapper prefixes, bias filtered out
    torch.testing.assert_close(raw["model"]["weight"], model.weight)
    assert raw["optimizer"]["param_groups"] == optimizer.optimizer.state_dict()["param_groups"]
    torch.testing.assert_close(raw["optimizer"]["state"][0]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
    assert raw["step"] == 7
    # the caller's state is untouched
    assert state["model"] is model and state["optimizer"] is optimizer


def test_load_in_place_returns_remainder(tmp_path):
    fabric = Fabric()
    model, optimizer = _trained(fabric, seed=0)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 5, "epoch": 2})

    other_model, other_optimizer = _trained(Fabric(), seed=1)
    assert not torch.equal(other_model.weight, model.weight)
    state = {"model": other_model, "optimizer": other_optimizer, "step": 0}
    remainder = fabric.load(tmp_path / "ckpt.pt", state)
    assert remainder == {"epoch": 2}
    assert state["step"] == 5  # plain values are replaced in the caller's dict
    assert state["model"] is other_model and state["optimizer"] is other_optimizer  # objects keep identity
    torch.testing.assert_close(other_model.weight, model.weight)
    loaded = other_optimizer.state_dict()
    expected = optimizer.state_dict()
    for key in expected["state"]:
        torch.testing.assert_close(loaded["state"][key]["exp_avg"], expected["state"][key]["exp_avg"])

    whole = fabric.load(tmp_path / "ckpt.pt")
    assert set(whole) == {"model", "optimizer", "step", "epoch"}
    assert whole["step"] == 5
    torch.testing.assert_close(whole["model"]["weight"], model.weight)
    assert set(fabric.load(tmp_path / "ckpt.pt", {})) == set(whole)


def test_load_strict(tmp_path):
    fabric = Fabric()
    model, _ = _trained(fabric)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "step": 1})
    with pytest.raises(KeyError, match="The requested state contains a key 'missing' that does not exist in the loaded"):
        fabric.load(tmp_path / "ckpt.pt", {"model": model, "missing": 3})
    state = {"model": model, "missing": 3}
    remainder = fabric.load(tmp_path / "ckpt.pt", state, strict=False)
    assert state["missing"] == 3  # kept its value
    assert remainder == {"step": 1}
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        fabric.load(tmp_path / "nope.pt", {"model": model})


def test_load_is_safe_by_default(tmp_path):
    fabric = Fabric()
    model, _ = _trained(fabric)
    torch.save({"model": model.module.state_dict(), "custom": CustomState(3)}, tmp_path / "full.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        fabric.load(tmp_path / "full.pt")
    checkpoint = fabric.load(tmp_path / "full.pt", weights_only=False)
    assert checkpoint["custom"].value == 3
    state = {"model": nn.Linear(3, 2), "custom": None}
    fabric.load(tmp_path / "full.pt", state, weights_only=False)
    assert state["custom"].value == 3
    torch.testing.assert_close(state["model"].weight, model.weight)


def test_load_raw(tmp_path):
    fabric = Fabric()
    model, optimizer = _trained(fabric)
    torch.save(model.module.state_dict(), tmp_path / "model.pt")
    torch.save(optimizer.optimizer.state_dict(), tmp_path / "optimizer.pt")

    plain = nn.Linear(3, 2)
    fabric.load_raw(tmp_path / "model.pt", plain)
    torch.testing.assert_close(plain.weight, model.weight)

    wrapped = fabric.setup(nn.Linear(3, 2))
    fabric.load_raw(tmp_path / "model.pt", wrapped)
    torch.testing.assert_close(wrapped.weight, model.weight)

    fresh = torch.optim.Adam(nn.Linear(3, 2).parameters(), lr=0.01)
    fabric.load_raw(tmp_path / "optimizer.pt", fresh)
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    bigger = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="Missing key"):
        fabric.load_raw(tmp_path / "model.pt", bigger)
    extra = nn.Linear(3, 2)
    extra.register_buffer("extra", torch.ones(1))
    fabric.load_raw(tmp_path / "model.pt", extra, strict=False)
    torch.testing.assert_close(extra.weight, model.weight)


# ---------------------------------------------------------------------------------------------------- callbacks / logging


def test_call_filters_kwargs_per_signature():
    class A:
        def __init__(self):
            self.calls = []

        def on_epoch_end(self, model):
            self.calls.append(("model", model))

        not_a_method = 3

    class B:
        def __init__(self):
            self.calls = []

        def on_epoch_end(self, model, results):
            self.calls.append(("model+results", model, results))

    class C:
        def __init__(self):
            self.calls = []

        def on_epoch_end(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    a, b, c = A(), B(), C()
    fabric = Fabric(callbacks=[a, b, c, object()])
    fabric.call("on_epoch_end", model="m", results={"acc": 1}, extra=True)
    assert a.calls == [("model", "m")]
    assert b.calls == [("model+results", "m", {"acc": 1})]
    assert c.calls == [((), {"model": "m", "results": {"acc": 1}, "extra": True})]
    fabric.call("on_epoch_end", "positional", results=2)
    assert c.calls[-1] == (("positional",), {"results": 2})
    fabric.call("undefined_hook")  # callbacks without it are skipped silently
    with pytest.warns(UserWarning, match="Skipping the callback `A.not_a_method` because it is not callable."):
        fabric.call("not_a_method")


def test_log_converts_tensors_and_passes_keywords():
    logger = RecordingLogger()
    fabric = Fabric(loggers=[logger])
    fabric.log("loss", torch.tensor(2.5))
    fabric.log_dict({"a": torch.tensor([[3]]), "b": 1, "nested": {"c": torch.tensor(0.5)}}, step=4)
    assert logger.calls == [
        {"metrics": {"loss": 2.5}, "step": None},
        {"metrics": {"a": 3, "b": 1, "nested": {"c": 0.5}}, "step": 4},
    ]
    assert isinstance(logger.calls[0]["metrics"]["loss"], float)
    with pytest.raises(ValueError, match="The metric `tensor\\(\\[3, 4\\]\\)` does not contain a single element"):
        fabric.log("bad", torch.tensor([3, 4]))
    fabric.log("requires_grad", torch.ones((), requires_grad=True) * 2)
    assert logger.calls[-1]["metrics"] == {"requires_grad": 2.0}


def test_the_strategys_own_metrics_are_logged_beside_the_users():
    """`Strategy.metrics()` (a fault-tolerant quorum's size, say) goes with every log call, at the user's step; a name
    the user logs keeps the user's value; without loggers the strategy is not even asked."""

    class Measured(SingleDeviceStrategy):
        asked = 0

        def metrics(self):
            self.asked += 1
            return {"strategy/size": 3.0, "loss": -1.0}

    logger = RecordingLogger()
    fabric = Fabric(strategy=Measured(device="cpu"), loggers=[logger])
    fabric.log("loss", torch.tensor(0.5), step=7)
    fabric.log_dict({"acc": 1.0}, step=8)
    assert logger.calls == [
        {"metrics": {"strategy/size": 3.0, "loss": 0.5}, "step": 7},
        {"metrics": {"strategy/size": 3.0, "loss": -1.0, "acc": 1.0}, "step": 8},
    ]
    quiet = Measured(device="cpu")
    Fabric(strategy=quiet).log("loss", 1.0)
    assert quiet.asked == 0
    assert SingleDeviceStrategy(device="cpu").metrics() == {}  # the default adds nothing


def test_log_without_loggers_is_a_no_op(tmp_path, monkeypatch):
    """Without loggers, logging returns at once: no tensor is read (`.item()` would wait for the device on a GPU),
    nothing is written, and no default logger appears. With a logger the same calls read every tensor."""
    reads = []

    class Recorded(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.item:
                reads.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    def metrics():
        return {"loss": torch.tensor(1.0).as_subclass(Recorded), "nested": {"acc": torch.tensor(0.5).as_subclass(Recorded)}}

    monkeypatch.chdir(tmp_path)
    fabric = Fabric(accelerator="cpu")
    assert fabric.loggers == []
    assert fabric.log("loss", metrics()["loss"]) is None
    assert fabric.log_dict(metrics(), step=1) is None
    assert reads == [] and fabric.loggers == [] and list(tmp_path.iterdir()) == []
    logger = RecordingLogger()
    Fabric(accelerator="cpu", loggers=[logger]).log_dict(metrics(), step=1)  # the control: now they are read
    assert reads == ["item", "item"] and logger.calls == [{"metrics": {"loss": 1.0, "nested": {"acc": 0.5}}, "step": 1}]


def test_log_through_a_real_csv_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0)
    fabric = Fabric(loggers=logger)
    fabric.log("loss", torch.tensor(0.25), step=0)
    fabric.log_dict({"loss": torch.tensor(0.125), "acc": 1.0}, step=1)
    logger.save()
    lines = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert [(r["step"], r["loss"]) for r in rows] == [("0", "0.25"), ("1", "0.125")]
    assert rows[1]["acc"] == "1.0"


def test_seed_everything_seeds_workers_by_default():
    assert Fabric.seed_everything(3) == 3
    assert os.environ["PL_GLOBAL_SEED"] == "3" and os.environ["PL_SEED_WORKERS"] == "1"
    first = torch.rand(2)
    Fabric().seed_everything(3, verbose=False)
    torch.testing.assert_close(torch.rand(2), first)
    Fabric.seed_everything(4, workers=False, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == "0"
    # the utility's own default stays False
    seed_everything(5, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == "0"


def test_repr_names_the_pieces():
    text = repr(Fabric(precision="64-true"))
    assert "cpu" in text and "SingleDeviceStrategy" in text and "64-true" in text


def test_a_short_training_loop_learns():
    """The five-step conversion of the seed, end to end on one device."""
    Fabric.seed_everything(0, verbose=False)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(64, 2)
    y = x.sum(dim=1, keepdim=True)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    losses = []
    for _ in range(20):
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] / 10


# ---------------------------------------------------------------------------------------------------- launch validation / CLI


class NeedsLaunch(SingleDeviceStrategy):
    """A strategy that, like the multi-process ones, must be launched before models and collectives are used."""

    requires_launch = True


def test_methods_that_need_launch(tmp_path):
    fabric = Fabric(strategy=NeedsLaunch())
    model, optimizer = model_and_optimizer()
    loader = DataLoader(list(range(2)))
    needs_launch = [
        lambda: fabric.setup(model, optimizer),
        lambda: fabric.setup_module(model),
        lambda: fabric.setup_optimizers(optimizer),
        lambda: fabric.setup_dataloaders(loader),
        lambda: fabric.barrier(),
        lambda: fabric.broadcast(1),
        lambda: fabric.all_gather(torch.ones(1)),
        lambda: fabric.all_reduce(torch.ones(1)),
        lambda: fabric.init_module(),
        lambda: fabric.save(tmp_path / "ckpt.pt", {"x": 1}),
        lambda: fabric.load(tmp_path / "ckpt.pt"),
    ]
    for call in needs_launch:
        with pytest.raises(RuntimeError, match="you must call `.launch\\(\\)` or use the CLI: `fabric run --help`"):
            call()
    assert not (tmp_path / "ckpt.pt").exists()

    # these work without launching
    torch.save(model.state_dict(), tmp_path / "raw.pt")
    fabric.load_raw(tmp_path / "raw.pt", model)
    with fabric.init_tensor(), fabric.autocast():
        pass
    assert torch.equal(fabric.to_device(torch.ones(1)), torch.ones(1))
    loss = model(torch.ones(1, 3)).sum()
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    fabric.log("x", 1.0)
    fabric.call("anything")
    fabric.print("ok")
    with fabric.rank_zero_first():
        pass

    fabric.launch()
    wrapped, _ = fabric.setup(model, optimizer)
    fabric.save(tmp_path / "ckpt.pt", {"model": wrapped, "x": 1})
    assert fabric.load(tmp_path / "ckpt.pt", {"model": wrapped}) == {"x": 1}
    assert fabric.all_reduce(2).item() == 2


def test_cli_settings_apply_under_the_cli_only(monkeypatch):
    monkeypatch.setenv("FABRIC_PRECISION", "64-true")
    assert Fabric().strategy.precision.precision == "32-true"  # a stray variable changes nothing
    monkeypatch.setenv("FABRIC_CLI_USED", "1")
    assert Fabric().strategy.precision.precision == "64-true"
    assert Fabric(precision="64-true").strategy.precision.precision == "64-true"  # agreeing is fine
    with pytest.raises(ValueError, match="Your code has `Fabric\\(precision='bf16-true', ...\\)` but it conflicts with the"):
        Fabric(precision="bf16-true")


def test_save_a_plain_state_dict_as_in_the_seed_example(tmp_path):
    """The seed's MNIST example saves ``state=model.state_dict()`` with keyword arguments."""
    fabric = Fabric()
    model = fabric.setup(nn.Linear(2, 2))
    fabric.save(path=tmp_path / "mnist_cnn.pt", state=model.state_dict())
    loaded = fabric.load(tmp_path / "mnist_cnn.pt")
    assert list(loaded) == ["weight", "bias"]
    torch.testing.assert_close(loaded["weight"], model.weight)
    gathered = fabric.all_gather(torch.tensor(3.0)).sum() / 3
    assert gathered.item() == 1.0
