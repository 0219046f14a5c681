"""The wrappers' plain paths (decided once per precision object) and LR schedulers on wrapped optimizers.

The plain paths must behave exactly like the full ones: these tests patch strategies and precisions, and compare the fast batch mover with ``move_data_to_device`` on many batch types.
"""

from __future__ import annotations

import pickle
import warnings
from collections import namedtuple
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR
from torch.utils.data import DataLoader, TensorDataset

from fabric_core import Fabric
from fabric_core.plugins import reset_registry
from fabric_core.precision.base import Precision
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_core.utilities.apply import batch_mover, move_data_to_device
from fabric_core.utilities.rank_zero import set_rank
from fabric_core.wrappers import FabricOptimizer


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in (
        "FABRIC_PLUGINS",
        "FABRIC_CLI_USED",
        "FABRIC_PRECISION",
        "FABRIC_STRATEGY",
        "FABRIC_ACCELERATOR",
    ):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    yield
    reset_registry()


class StepRecordingStrategy(SingleDeviceStrategy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = 0

    def optimizer_step(self, optimizer, **kwargs):
        self.steps += 1
        return super().optimizer_step(optimizer, **kwargs)


class MarkingPrecision(Precision):
    """Doubles floating outputs and records the hooks it sees: every piece of it is observable."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward_context(self) -> AbstractContextManager:
        self.calls.append("forward_context")
        return nullcontext()

    def convert_output(self, data: Any) -> Any:
        return data * 2

    def pre_backward(self, tensor, module):
        self.calls.append("pre_backward")
        return tensor

    def optimizer_step(self, optimizer, **kwargs):
        self.calls.append("optimizer_step")
        return optimizer.step(**kwargs)


# ---------------------------------------------------------------------------------------------------- LR schedulers

SCHEDULERS = {
    "StepLR": lambda opt: StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: LambdaLR(opt, lr_lambda=lambda epoch: 1.0 / (epoch + 1)),
    "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=1.0, total_steps=10),
}


def _train(model, optimizer, scheduler, backward, steps: int = 6) -> list[float]:
    lrs = []
    for _ in range(steps):
        backward(model(torch.ones(2, 2)).sum())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def _reference(make_scheduler) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lrs = _train(model, optimizer, make_scheduler(optimizer), lambda loss: loss.backward())
    return lrs, model.weight.detach().clone()


@pytest.mark.parametrize(
    "strategy_cls", [SingleDeviceStrategy, StepRecordingStrategy], ids=["plain", "recording"]
)
@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("where", ["wrapped", "raw_before_setup"])
def test_lr_scheduler_steps_like_plain_torch(name, where, strategy_cls):
    expected_lrs, expected_weight = _reference(SCHEDULERS[name])
    strategy = strategy_cls(device=torch.device("cpu"))
    fabric = Fabric(strategy=strategy)
    torch.manual_seed(0)
    module = nn.Linear(2, 1)
    raw = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # incl. torch's "lr_scheduler.step() before optimizer.step()" warning
        if where == "wrapped":
            model, optimizer = fabric.setup(module, raw)
            scheduler = SCHEDULERS[name](optimizer)
            assert scheduler.optimizer is optimizer
        else:
            scheduler = SCHEDULERS[name](raw)
            model, optimizer, returned = fabric.setup(module, raw, scheduler=scheduler)
            assert returned is scheduler
        lrs = _train(model, optimizer, scheduler, fabric.backward)
    assert lrs == pytest.approx(expected_lrs)
    torch.testing.assert_close(module.weight, expected_weight)
    # the scheduler tracks `step` on the optimizer it was given
    assert hasattr(scheduler.optimizer.step, "_wrapped_by_lr_sched")
    if strategy_cls is StepRecordingStrategy:
        assert strategy.steps == 6  # the scheduler's patch never bypasses the strategy
    if where == "wrapped":
        # the patch stays on the wrapper: the raw optimizer keeps its class's step and stays picklable
        assert "step" not in vars(raw) and type(raw) is torch.optim.SGD
        assert pickle.loads(pickle.dumps(raw)).param_groups[0]["lr"] == pytest.approx(expected_lrs[-1])


def test_scheduler_created_on_raw_optimizer_after_setup_does_not_bypass_the_strategy():
    strategy = StepRecordingStrategy(device=torch.device("cpu"))
    fabric = Fabric(strategy=strategy)
    module = nn.Linear(2, 1)
    raw = torch.optim.SGD(module.parameters(), lr=1.0)
    model, optimizer = fabric.setup(module, raw)
    scheduler = StepLR(raw, step_size=1, gamma=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, scheduler, fabric.backward, steps=2)
    assert strategy.steps == 2
    assert raw.param_groups[0]["lr"] == pytest.approx(0.01)


def test_assigned_optimizer_methods_stay_on_the_wrapper():
    fabric = Fabric()
    raw = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    optimizer = fabric.setup_optimizers(raw)
    calls = []

    def patched_zero_grad(*args, **kwargs):
        calls.append("zero_grad")

    optimizer.zero_grad = patched_zero_grad
    optimizer.zero_grad()
    assert calls == ["zero_grad"] and "zero_grad" not in vars(raw)
    raw.zero_grad()  # the raw optimizer is unaffected
    assert calls == ["zero_grad"]
    del optimizer.zero_grad
    assert optimizer.zero_grad == raw.zero_grad  # back to forwarding to the optimizer
    with pytest.raises(AttributeError):
        del optimizer.zero_grad

    other = fabric.setup_optimizers(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    optimizer.step = patched_zero_grad
    assert optimizer.step is patched_zero_grad and "step" not in vars(raw)
    assert other.step.__func__ is FabricOptimizer.step  # per wrapper, not per class
    del optimizer.step
    assert optimizer.step.__func__ is FabricOptimizer.step
    optimizer.state_dict = dict  # any of the wrapper's own methods
    assert optimizer.state_dict() == {} and "state_dict" not in vars(raw)


# ---------------------------------------------------------------------------------------------------- plain paths


def test_plain_paths_are_chosen_only_for_plain_precisions():
    fabric = Fabric()
    module = nn.Linear(2, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    precision = fabric.strategy.precision
    for plan in (model._paths, optimizer._paths, fabric._paths):  # one kind of plan, read by every hot path
        assert plan.precision is precision and plan.forward and plan.backward and plan.step
    double = Fabric(precision="64-true")
    double_model = double.setup(nn.Linear(2, 1))
    assert double_model._paths.precision is double.strategy.precision
    assert not double_model._paths.forward and double_model._paths.backward  # casts, but backward stays plain


def test_a_bound_precision_cannot_be_replaced_after_setup():
    """The plans are made for the bound precision, which is read-only (issue 27: resolve once, bind once)."""
    fabric = Fabric()
    module = nn.Linear(2, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.ones(1, 2)
    bound = fabric.strategy.precision

    marking = MarkingPrecision()
    with pytest.raises(AttributeError, match=r"`SingleDeviceStrategy.precision` is read-only once `Fabric\(...\)`"):
        fabric.strategy.precision = marking
    assert fabric.strategy.precision is bound and model._paths.precision is bound
    out = model(x)
    torch.testing.assert_close(out, module(x))  # still the plain path: no conversion, plain backward allowed
    out.sum().backward()
    fabric.backward(model(x).sum())
    optimizer.step()
    assert marking.calls == []


def test_instance_patched_precision_and_strategy_take_the_full_path():
    precision = Precision()
    seen = []
    precision.convert_output = lambda data: seen.append("convert_output") or data  # type: ignore[method-assign]
    strategy = SingleDeviceStrategy(device=torch.device("cpu"), precision=precision)
    original_step = strategy.optimizer_step
    strategy.optimizer_step = lambda opt, **kw: seen.append("optimizer_step") or original_step(opt, **kw)  # type: ignore[method-assign]
    fabric = Fabric(strategy=strategy)
    module = nn.Linear(2, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model(torch.ones(1, 2))
    optimizer.step()
    assert seen == ["convert_output", "optimizer_step"]


def test_reassigned_inner_module_is_used():
    fabric = Fabric()
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)
    model = fabric.setup(first)
    model._forward_module = second
    x = torch.ones(1, 2)
    torch.testing.assert_close(model(x), second(x))
    assert any(m is second for m in model.modules())
    assert not any(m is first for m in model._forward_module.modules())


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_direct_call_still_runs_hooks_compile_patches_and_tracing():
    fabric = Fabric()
    inner = nn.Linear(2, 2)
    model = fabric.setup(inner)
    x = torch.ones(1, 2)
    seen = []

    handle = model.register_forward_hook(lambda module, args, out: seen.append("wrapper") or out * 0)
    assert torch.equal(model(x), torch.zeros(1, 2)) and seen == ["wrapper"]  # the wrapper's own hooks run
    handle.remove()
    torch.testing.assert_close(model(x), inner(x))

    from torch.nn.modules.module import register_module_forward_pre_hook

    handle = register_module_forward_pre_hook(lambda module, args: seen.append(type(module).__name__))
    try:
        model(x)
    finally:
        handle.remove()
    assert seen[1:] == ["FabricModule", "Linear"]  # module-wide hooks see the wrapper too

    model.forward = lambda *args, **kwargs: "patched"  # an instance-level forward is honoured
    assert model(x) == "patched"
    del model.forward

    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), inner(x))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), inner(x))
    model.compile(backend="eager")
    assert model._compiled_call_impl is not None
    torch.testing.assert_close(model(x), inner(x))


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_tracing_through_the_direct_call_matches_the_full_path():
    """The direct call checks torch's traced-module map, not the tracing state: tracing a function that calls the
    wrapper gives the inner module's graph, and tracing a module that holds the wrapper still names the wrapper's
    scope (its ``nn.Module.__call__`` runs then)."""
    fabric = Fabric()
    inner = nn.Linear(2, 2)
    model = fabric.setup(inner)
    x = torch.ones(1, 2)

    activation = fabric.setup(nn.Tanh())  # no parameters: a traced function may not hold ones that need grad
    traced_function = torch.jit.trace(lambda t: activation(t) * 2, x)
    torch.testing.assert_close(traced_function(x * 3), torch.tanh(x * 3) * 2)
    assert "aten::tanh" in str(traced_function.graph)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wrapped = model

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.wrapped(t) + 1

    traced_module = torch.jit.trace(Holder(), x)
    torch.testing.assert_close(traced_module(x * 3), inner(x * 3) + 1)
    scopes = {node.scopeName() for node in traced_module.inlined_graph.nodes()}
    assert "__module.wrapped/__module.wrapped._forward_module" in scopes, scopes  # the wrapper's own scope too


def test_late_callbacks_fire_on_the_plain_step():
    class Callback:
        def __init__(self) -> None:
            self.calls = 0

        def on_after_optimizer_step(self, strategy, optimizer):
            self.calls += 1

    fabric = Fabric()
    raw = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    optimizer = fabric.setup_optimizers(raw)
    optimizer.step()
    late = Callback()
    fabric._callbacks.append(late)
    optimizer.step()
    assert late.calls == 1


def test_plain_backward_is_still_a_fabric_backward_for_other_fabrics_models():
    class NeedsFabricBackward(Precision):
        def pre_backward(self, tensor, module):
            return tensor

    guarded = Fabric(plugins=NeedsFabricBackward())
    plain = Fabric()
    model = guarded.setup(nn.Linear(2, 1))
    loss = model(torch.ones(1, 2)).sum()
    plain.backward(loss)  # the guard on `model`'s output sees a Fabric backward
    assert model.weight.grad is not None


# ---------------------------------------------------------------------------------------------------- batch mover

Pair = namedtuple("Pair", ["x", "y"])


class Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device, **kwargs):
        return Box(self.t.to(device, **kwargs))


def _batches() -> dict[str, Any]:
    t = torch.arange(6.0).reshape(2, 3)
    return {
        "tensor": t,
        "list": [t, t.long()],
        "tuple": (t, t + 1),
        "empty_list": [],
        "dict": {"a": t, "b": t.long()},
        "mixed_list": [t, 3, "name"],
        "nested": {"x": [t, (t,)], "y": t},
        "namedtuple": Pair(t, t),
        "parameter": [nn.Parameter(t.clone())],
        "custom": [Box(t)],
        "string": "just text",
    }


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
        if a.device.type != "meta":
            assert torch.equal(a, b)
    elif isinstance(a, Box):
        _same(a.t, b.t)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu", 0), "meta"])
@pytest.mark.parametrize("kind", list(_batches()))
def test_batch_mover_matches_move_data_to_device(kind, device):
    batch = _batches()[kind]
    moved = batch_mover(device)(batch)
    _same(moved, move_data_to_device(batch, device))
    if isinstance(batch, list):
        assert moved is not batch  # a new container, as the generic walk builds


def test_batch_mover_leaves_cpu_tensors_in_place():
    t = torch.ones(2)
    batch = [t, t]
    moved = batch_mover("cpu")(batch)
    assert moved[0] is t and moved[1] is t
    assert batch_mover(torch.device("cpu"))({"a": t})["a"] is t


def test_dataloader_batches_are_moved_like_before():
    fabric = Fabric()
    dataset = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2))
    batches = list(loader)
    assert [type(b) for b in batches] == [list, list]
    assert torch.equal(batches[1][0], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert batches[0][1].dtype == torch.int64
    dict_loader = fabric.setup_dataloaders(
        DataLoader([{"x": torch.ones(1), "id": i} for i in range(2)], batch_size=2)
    )
    (batch,) = list(dict_loader)
    assert torch.equal(batch["id"], torch.tensor([0, 1])) and batch["x"].shape == (2, 1)


@pytest.mark.parametrize("marking", [False, True])
def test_a_step_reports_progress_only_while_marking(monkeypatch: pytest.MonkeyPatch, marking: bool):
    """Without a ledger or a watchdog the per-step calls skip the marks; with them, forward, backward and step each
    count a beat of progress, also for objects set up before the marks were switched on (the flag is read on every
    call)."""
    from fabric_core.runtime import goodput

    fabric = Fabric(accelerator="cpu", devices=1)
    layer = nn.Linear(2, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    monkeypatch.setattr(goodput, "marking", marking)  # as start_watchdog / goodput.start do, after setup
    counts = []
    for call in (lambda: model(torch.ones(1, 2)), lambda: fabric.backward(model(torch.ones(1, 2)).sum()), optimizer.step):
        before = goodput.beats
        call()
        counts.append(goodput.beats - before)
    # a forward; a backward (and its forward); a step: each one beat, which the monitor thread reads as progress
    assert counts == ([1, 2, 1] if marking else [0, 0, 0])


def test_the_watchdog_flag_follows_start_and_stop(monkeypatch: pytest.MonkeyPatch):
    from fabric_core.runtime import hang

    monkeypatch.setattr(hang, "watching", False)
    monkeypatch.delenv(hang.HANG_TIMEOUT_VARIABLE, raising=False)
    hang.start_watchdog(0)
    assert hang.watching is False  # one process and no FABRIC_HANG_TIMEOUT: nobody waits for it, nothing watches
    monkeypatch.setenv(hang.HANG_TIMEOUT_VARIABLE, "0")
    hang.start_watchdog(0, world_size=2)
    assert hang.watching is False  # switched off
    for value, world_size in (("600", 1), ("", 2)):  # a fixed limit; the default for several processes
        monkeypatch.setattr(hang, "_watchdog", None)
        monkeypatch.setenv(hang.HANG_TIMEOUT_VARIABLE, value)
        try:
            hang.start_watchdog(0, world_size=world_size)
            assert hang.watching is True
        finally:
            hang.stop_watchdog()
        assert hang.watching is False
