"""The objects ``fabric.setup*`` returns: FabricModule, FabricOptimizer, FabricDataLoader and ``is_wrapped``."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

from fabric_core import Fabric, is_wrapped
from fabric_core.plugins import reset_registry
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_core.utilities.rank_zero import set_rank
from fabric_core.wrappers import FabricDataLoader, FabricModule, FabricOptimizer, unwrap_objects


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in ("FABRIC_PLUGINS", "FABRIC_CLI_USED", "FABRIC_PRECISION", "FABRIC_STRATEGY", "FABRIC_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    dtype = torch.get_default_dtype()
    yield
    reset_registry()
    assert torch.get_default_dtype() == dtype


class Recorder(nn.Module):
    """Records the dtypes its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.seen: list[Any] = []

    def forward(self, x, idx, flag=None):
        self.seen.append((x.dtype, idx.dtype, flag.dtype if flag is not None else None, torch.get_default_dtype()))
        return {"out": self.layer(x), "idx": idx}


class Original(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.attribute = "value"
        self._scale = 1.0

    def forward(self, x):
        return self.layer(x)

    def training_step(self, x):
        return self(x).sum() * 2

    def uses_submodule(self, x):
        return self.layer(x)

    def calls_itself(self, x):
        return self(x)

    def normal_method(self, x):
        return x + 1

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value * 10


class CountingWrapper(nn.Module):
    """Stands in for what a strategy (e.g. DDP) wraps the module in."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def strategy() -> SingleDeviceStrategy:
    return Fabric().strategy


# ---------------------------------------------------------------------------------------------------- FabricModule


@pytest.mark.parametrize(("precision", "dtype"), [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_forward_converts_floating_inputs_and_outputs(precision, dtype):
    fabric = Fabric(precision=precision)
    original = Recorder()
    model = fabric.setup(original)
    assert model.layer.weight.dtype == dtype
    x = torch.randn(3, 2)
    idx = torch.arange(3)
    out = model(x, idx, flag=torch.ones(1, dtype=torch.float16))
    assert original.seen == [(dtype, torch.int64, dtype, dtype)]  # ints untouched, default dtype switched
    assert out["out"].dtype == torch.float32  # back to the default dtype
    assert out["idx"].dtype == torch.int64
    assert x.dtype == torch.float32  # the caller's tensor is not modified
    fabric.backward(out["out"].float().sum())
    assert model.layer.weight.grad.dtype == dtype


def test_forward_is_untouched_with_32_true():
    fabric = Fabric()
    original = Recorder()
    model = fabric.setup(original)
    x = torch.randn(3, 2, dtype=torch.float64)
    out = model(x.float(), torch.arange(3))
    assert original.seen == [(torch.float32, torch.int64, None, torch.float32)]
    torch.testing.assert_close(out["out"], original.layer(x.float()))


def test_state_dict_has_no_wrapper_prefixes():
    fabric = Fabric()
    original = Original()
    model = fabric.setup(original)
    assert list(model.state_dict()) == ["layer.weight", "layer.bias"]
    new = {k: torch.zeros_like(v) for k, v in original.state_dict().items()}
    model.load_state_dict(new)
    assert torch.count_nonzero(original.layer.weight) == 0
    # extra keyword arguments reach the original module
    replacement = {k: torch.ones_like(v) for k, v in new.items()}
    model.load_state_dict(replacement, assign=True)
    assert original.layer.weight.data_ptr() == replacement["layer.weight"].data_ptr()  # assigned, not copied
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({"layer.weight": torch.ones(2, 2)})
    model.load_state_dict({"layer.weight": torch.full((2, 2), 3.0)}, strict=False)
    assert torch.equal(original.layer.weight, torch.full((2, 2), 3.0))


def test_attribute_access_falls_through():
    fabric = Fabric()
    original = Original()
    model = fabric.setup(original)
    assert model.module is original
    assert model.attribute == "value"
    assert model.layer is original.layer
    assert model.scale == 1.0
    assert model.normal_method(1) == 2
    assert model.training_step.__func__ is Original.training_step  # one device: methods are returned directly
    assert model.forward.__func__ is FabricModule.forward
    with pytest.raises(AttributeError):
        _ = model.does_not_exist


def test_setattr_rules():
    fabric = Fabric()
    original = Original()
    model = fabric.setup(original)

    model.new_attribute = 5  # on neither: lands on the original
    assert original.new_attribute == 5 and "new_attribute" not in model.__dict__
    model.extra = nn.Linear(1, 1)  # a new submodule shows up in both module trees
    assert original.extra is model.extra
    assert any(m is original.extra for m in model.modules())
    assert any(m is original.extra for m in original.modules())

    model.attribute = "changed"  # exists on the original only
    assert original.attribute == "changed" and "attribute" not in model.__dict__
    model.scale = 2.0  # a property setter on the original runs
    assert original._scale == 20.0 and "scale" not in model.__dict__

    model.training = False  # exists on both: set on both
    assert model.training is False and original.training is False

    def patched_forward(*args, **kwargs):
        return "patched"

    model.forward = patched_forward  # forward only patches the wrapper
    assert model.forward is patched_forward
    assert original.forward.__func__ is Original.forward
    model.__custom__ = 1
    assert model.__dict__["__custom__"] == 1 and not hasattr(original, "__custom__")


def test_dtype_and_device():
    fabric = Fabric(precision="64-true")
    model = fabric.setup(nn.Linear(2, 2))
    assert model.dtype == torch.float64
    assert model.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="Cannot set the dtype explicitly. Please use module.to\\(new_dtype\\)."):
        model.dtype = torch.float32
    empty = fabric.setup(nn.ReLU())
    assert empty.device == torch.device("cpu")


def test_mark_forward_method_errors():
    model = FabricModule(CountingWrapper(original := Original()), strategy(), original_module=original)
    with pytest.raises(TypeError, match="Expected a method or a string, but got: function"):
        model.mark_forward_method(lambda x: x)
    with pytest.raises(ValueError, match="You cannot mark the forward method itself as a forward method."):
        model.mark_forward_method("forward")
    with pytest.raises(ValueError, match="forward method itself"):
        model.mark_forward_method(original.forward)
    with pytest.raises(AttributeError, match="You marked 'missing' as a forward method, but `Original.missing` does not"):
        model.mark_forward_method("missing")
    with pytest.raises(AttributeError, match="`Original.attribute` does not exist or is not a method"):
        model.mark_forward_method("attribute")
    model.mark_forward_method("uses_submodule")
    model.mark_forward_method(original.normal_method)
    assert {"uses_submodule", "normal_method", "training_step"} <= model._forward_methods


def test_marked_methods_go_through_the_strategy_wrapper():
    original = Original()
    wrapper = CountingWrapper(original)
    model = FabricModule(wrapper, strategy(), original_module=original)
    x = torch.randn(3, 2)
    expected = original.training_step(x)
    assert torch.equal(model.training_step(x), expected)
    assert wrapper.calls == 1  # routed through the wrapper's forward
    assert original.forward.__func__ is Original.forward  # restored afterwards
    assert "forward" not in original.__dict__
    assert torch.equal(model(x), original(x))
    assert wrapper.calls == 2


def test_unmarked_methods_calling_submodules_are_caught():
    original = Original()
    wrapper = CountingWrapper(original)
    model = FabricModule(wrapper, strategy(), original_module=original)
    x = torch.randn(3, 2)
    assert torch.equal(model.normal_method(x), x + 1)  # no submodule: fine
    assert model.normal_method.__wrapped__ == original.normal_method
    with pytest.raises(RuntimeError, match="You are calling the method `Original.uses_submodule\\(\\)` from outside the"):
        model.uses_submodule(x)
    with pytest.raises(RuntimeError, match="mark_forward_method\\('calls_itself'\\)"):
        model.calls_itself(x)
    # the hooks are removed again, even after the error
    assert not original.layer._forward_pre_hooks and not original._forward_pre_hooks
    model.mark_forward_method("uses_submodule")
    assert torch.equal(model.uses_submodule(x), original.layer(x))
    assert wrapper.calls == 1


def test_falsy_original_module_is_kept():
    original = nn.Sequential()  # empty containers are falsy
    model = FabricModule(CountingWrapper(original), strategy(), original_module=original)
    assert model.module is original
    assert len(model.module) == 0
    model.appended = nn.Linear(1, 1)
    assert original.appended is model.appended


# ---------------------------------------------------------------------------------------------------- FabricOptimizer


class StepRecordingStrategy(SingleDeviceStrategy):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[Any, dict]] = []

    def optimizer_step(self, optimizer, **kwargs):
        self.steps.append((optimizer, kwargs))
        return super().optimizer_step(optimizer, **kwargs)


class StepCallback:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls.append({"strategy": strategy, "optimizer": optimizer})


def test_optimizer_wrapper_is_an_instance_of_the_original_class():
    fabric = Fabric()
    model = nn.Linear(2, 2)
    raw = torch.optim.Adam(model.parameters(), lr=0.1)
    _, optimizer = fabric.setup(model, raw)
    assert isinstance(optimizer, torch.optim.Adam) and isinstance(optimizer, FabricOptimizer)
    assert type(optimizer).__name__ == "FabricAdam"
    assert optimizer.optimizer is raw
    assert optimizer.param_groups is raw.param_groups
    assert optimizer.state is raw.state
    assert optimizer.defaults is raw.defaults
    optimizer.param_groups[0]["lr"] = 0.5
    assert raw.param_groups[0]["lr"] == 0.5


def test_optimizer_state_is_shared_and_loadable():
    fabric = Fabric()
    model = nn.Linear(2, 2)
    raw = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, raw)
    fabric.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    assert optimizer.state_dict()["state"][0]["step"] == 1
    saved = optimizer.state_dict()

    other = torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=0.3)
    wrapped = fabric.setup_optimizers(other)
    wrapped.load_state_dict(saved)
    # load_state_dict replaces state/param_groups on the raw optimizer: the wrapper sees the new ones
    assert wrapped.state is other.state and wrapped.param_groups is other.param_groups
    assert wrapped.param_groups[0]["lr"] == 0.1
    first = next(iter(other.state.values()))
    assert first["step"] == 1
    extra = nn.Parameter(torch.ones(1))
    wrapped.add_param_group({"params": [extra]})
    assert len(other.param_groups) == 2


def test_optimizer_wrapper_leaves_the_raw_optimizer_clean():
    fabric = Fabric()
    raw = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    fabric.setup_optimizers(raw)
    assert not {"_optimizer", "_strategy", "_callbacks"} & set(vars(raw))
    assert type(raw) is torch.optim.SGD
    restored = pickle.loads(pickle.dumps(raw))
    assert restored.param_groups[0]["lr"] == 0.1


def test_step_goes_through_the_strategy_and_fires_callbacks():
    strategy = StepRecordingStrategy()
    callback = StepCallback()
    fabric = Fabric(strategy=strategy, callbacks=[callback, object()])
    module = nn.Linear(2, 1)
    raw = torch.optim.SGD(module.parameters(), lr=1.0)
    model, optimizer = fabric.setup(module, raw)
    fabric.backward(model(torch.ones(1, 2)).sum())
    before = module.weight.detach().clone()
    optimizer.step()
    assert strategy.steps == [(raw, {})]
    torch.testing.assert_close(module.weight, before - 1.0)
    assert callback.calls == [{"strategy": strategy, "optimizer": raw}]

    late = StepCallback()
    fabric._callbacks.append(late)  # callbacks are looked up at step time

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        fabric.backward(loss)
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert strategy.steps[-1] == (raw, {"closure": closure})
    assert len(callback.calls) == 2 and len(late.calls) == 1


def test_zero_grad_forwards_arguments():
    fabric = Fabric()
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Linear(2, 1)))
    fabric.backward(model(torch.ones(1, 2)).sum())
    optimizer.zero_grad(set_to_none=False)
    assert torch.count_nonzero(model.weight.grad) == 0
    optimizer.zero_grad()
    assert model.weight.grad is None


# ---------------------------------------------------------------------------------------------------- FabricDataLoader


class EpochSampler(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_dataloader_wrapper_attributes_and_len():
    dataset = TensorDataset(torch.arange(10.0))

    def init_fn(worker_id):
        pass

    raw = DataLoader(dataset, batch_size=4, worker_init_fn=init_fn)
    loader = FabricDataLoader(raw)
    assert loader.device is None
    assert len(loader) == 3
    assert loader.dataset is dataset and loader.batch_size == 4
    assert loader.sampler is raw.sampler and loader.worker_init_fn is init_fn
    assert loader._dataloader is raw
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert FabricDataLoader(raw, device=torch.device("cpu")).device == torch.device("cpu")


def test_set_epoch_deduplicated_between_sampler_and_batch_sampler():
    sampler = EpochSampler(4)
    raw = DataLoader(list(range(4)), batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False))
    loader = FabricDataLoader(raw)
    assert raw.sampler is not sampler  # DataLoader keeps a default sampler beside the batch sampler
    for _ in range(2):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert sampler.epochs == [0, 1]


def _consume(iterator, n):
    return [next(iterator).tolist() for _ in range(n)]


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["no-move", "move"])
def test_dataloader_state_holds_the_epoch_to_continue(device):
    sampler = EpochSampler(6)
    loader = FabricDataLoader(DataLoader(list(range(6)), sampler=sampler, batch_size=2), device=device)
    assert loader.state_dict() == {"fabric_epoch": 0, "fabric_mid_epoch": False}  # a plain DataLoader has no state of its own
    list(loader)
    assert loader.state_dict() == {"fabric_epoch": 1, "fabric_mid_epoch": False}  # epoch 0 ran to its end: the next one is 1
    iterator = iter(loader)
    _consume(iterator, 1)
    assert loader.state_dict() == {"fabric_epoch": 1, "fabric_mid_epoch": True}  # epoch 1 is unfinished: it is the one to continue
    list(iterator)
    assert loader.state_dict() == {"fabric_epoch": 2, "fabric_mid_epoch": False}

    resumed_sampler = EpochSampler(6)
    resumed = FabricDataLoader(DataLoader(list(range(6)), sampler=resumed_sampler, batch_size=2), device=device)
    resumed.load_state_dict({"fabric_epoch": 2})
    assert [b.tolist() for b in resumed] == [[0, 1], [2, 3], [4, 5]]
    list(resumed)
    assert resumed_sampler.epochs == [2, 2, 3]  # at load time (for early iterators), then at each epoch
    assert resumed.state_dict() == {"fabric_epoch": 4, "fabric_mid_epoch": False}


def test_dataloader_state_of_a_distributed_sampler_keeps_its_seed():
    from torch.utils.data import DistributedSampler

    data = list(range(8))
    saved = FabricDataLoader(DataLoader(data, sampler=DistributedSampler(data, 2, 1, shuffle=True, seed=5)))
    state = saved.state_dict()
    assert state == {"fabric_epoch": 0, "fabric_mid_epoch": False, "fabric_sampler_seed": 5}
    other = DistributedSampler(data, 2, 1, shuffle=True, seed=0)
    resumed = FabricDataLoader(DataLoader(data, sampler=other))
    resumed.load_state_dict({"fabric_epoch": 3, "fabric_sampler_seed": 5})
    assert other.seed == 5 and other.epoch == 3


def _stateful_loader(seed: int):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="`make setup` installs torchdata")
    torch.manual_seed(seed)  # seeds the loader's RandomSampler generator
    return stateful.StatefulDataLoader(list(range(10)), batch_size=2, shuffle=True)


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["no-move", "move"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_stateful_dataloader_continues_mid_epoch(device, epoch):
    loader = FabricDataLoader(_stateful_loader(seed=1), device=device)
    for _ in range(epoch):
        list(loader)
    iterator = iter(loader)
    _consume(iterator, 2)
    state = loader.state_dict()
    assert state["fabric_epoch"] == epoch and "_num_yielded" in state["dataloader"]
    expected = [[b.tolist() for b in iterator]] + [[b.tolist() for b in loader]]

    resumed = FabricDataLoader(_stateful_loader(seed=2), device=device)  # another RNG state
    resumed.load_state_dict(state)
    assert [[b.tolist() for b in resumed] for _ in range(2)] == expected
    assert resumed._num_iter_calls == epoch + 2


def test_stateful_dataloader_saved_at_an_epoch_end_starts_the_next():
    loader = FabricDataLoader(_stateful_loader(seed=1))
    list(loader)
    state = loader.state_dict()
    assert state["fabric_epoch"] == 1
    expected = [b.tolist() for b in loader]
    resumed = FabricDataLoader(_stateful_loader(seed=2))
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == expected and len(expected) == 5


def test_dataloader_loads_the_state_of_the_unwrapped_loader():
    """A checkpoint written from the unwrapped loader (as the reference saves it) loads; the epoch stays."""
    raw = _stateful_loader(seed=1)
    iterator = iter(raw)
    next(iterator)
    inner_state = raw.state_dict()
    expected = [b.tolist() for b in iterator]
    resumed = FabricDataLoader(_stateful_loader(seed=2))
    resumed.load_state_dict(inner_state)
    assert [b.tolist() for b in resumed] == expected and resumed._num_iter_calls == 1


def test_dataloader_state_of_a_stateful_loader_into_a_plain_one_raises():
    loader = FabricDataLoader(DataLoader(list(range(4))))
    with pytest.raises(TypeError, match="holds the state of a stateful dataloader.*`DataLoader`.*StatefulDataLoader"):
        loader.load_state_dict({"fabric_epoch": 1, "dataloader": {"_num_yielded": 1}})
    with pytest.raises(TypeError, match="expects the dict"):
        loader.load_state_dict([1])


def test_fabric_save_and_load_keep_the_dataloader_epoch(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    sampler = EpochSampler(4)
    loader = fabric.setup_dataloaders(DataLoader(list(range(4)), sampler=sampler, batch_size=2))
    list(loader)
    list(loader)
    fabric.save(tmp_path / "ckpt.pt", {"loader": loader, "step": 7}).wait()
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"] == {"fabric_epoch": 2, "fabric_mid_epoch": False}

    resumed_sampler = EpochSampler(4)
    resumed = fabric.setup_dataloaders(DataLoader(list(range(4)), sampler=resumed_sampler, batch_size=2))
    state = {"loader": resumed, "step": 0}
    fabric.load(tmp_path / "ckpt.pt", state)  # weights_only: the state holds plain values only
    assert state["loader"] is resumed and state["step"] == 7
    list(resumed)
    assert resumed_sampler.epochs[-1] == 2


# ---------------------------------------------------------------------------------------------------- is_wrapped


def test_is_wrapped():
    fabric = Fabric()
    module = nn.Linear(2, 2)
    raw_optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    raw_loader = DataLoader(list(range(3)))
    assert not is_wrapped(None)
    assert not is_wrapped(module) and not is_wrapped(raw_optimizer) and not is_wrapped(raw_loader)
    assert not is_wrapped(torch.compile(module, backend="eager"))
    model, optimizer = fabric.setup(module, raw_optimizer)
    loader = fabric.setup_dataloaders(raw_loader)
    assert is_wrapped(model) and is_wrapped(optimizer) and is_wrapped(loader)
    assert is_wrapped(torch.compile(model, backend="eager"))


def test_unwrap_objects_recurses():
    fabric = Fabric()
    module = nn.Linear(2, 2)
    raw_optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    raw_loader = DataLoader(list(range(3)))
    model, optimizer = fabric.setup(module, raw_optimizer)
    loader = fabric.setup_dataloaders(raw_loader)
    state = {"model": model, "nested": {"opt": optimizer, "list": [loader, 3]}, "compiled": torch.compile(model, backend="eager")}
    out = unwrap_objects(state)
    assert out["model"] is module and out["compiled"] is module
    assert out["nested"]["opt"] is raw_optimizer
    assert out["nested"]["list"] == [raw_loader, 3]
    assert state["model"] is model  # the input is not modified
    kept = unwrap_objects(state, dataloaders=False)  # what checkpoints use: the loader saves its own state
    assert kept["nested"]["list"] == [loader, 3] and kept["model"] is module


def test_environment_untouched_by_wrappers():
    before = dict(os.environ)
    fabric = Fabric()
    module = nn.Linear(1, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    list(fabric.setup_dataloaders(DataLoader(list(range(2)))))
    assert dict(os.environ) == before


def test_a_stateful_loader_is_saved_in_the_references_layout_and_resumes_both_ways(tmp_path):
    """Under the loader's key: the wrapped loader's own state, as the reference (which saves the unwrapped loader)
    stores it, so the reference resumes from our checkpoint; our epoch counter is stored apart."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="`make setup` installs torchdata")
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(_stateful_loader(seed=1))
    list(loader)
    iterator = iter(loader)
    _consume(iterator, 2)
    fabric.save(tmp_path / "ours.ckpt", {"loader": loader, "step": 3}).wait()
    expected = [b.tolist() for b in iterator]

    raw = torch.load(tmp_path / "ours.ckpt", weights_only=True)
    assert "_num_yielded" in raw["loader"] and "fabric_epoch" not in raw["loader"]
    assert raw["__fabric_extra__"] == {"loader": {"fabric_epoch": 1, "fabric_mid_epoch": True}}
    # What the reference does with it: the unwrapped loader loads the entry under its key.
    reference_side = _stateful_loader(seed=2)
    reference_side.load_state_dict(raw["loader"])
    assert [b.tolist() for b in reference_side] == expected

    # Ours: the rest of the epoch in progress, and the epoch counter back.
    resumed = fabric.setup_dataloaders(_stateful_loader(seed=3))
    state = {"loader": resumed, "step": 0}
    assert fabric.load(tmp_path / "ours.ckpt", state) == {}
    assert [b.tolist() for b in resumed] == expected and resumed._num_iter_calls == 2 and state["step"] == 3

    # A checkpoint of the reference (the unwrapped loader's state alone) resumes here too.
    torch.save({"loader": raw["loader"], "step": 3}, tmp_path / "reference.ckpt")
    from_reference = fabric.setup_dataloaders(_stateful_loader(seed=4))
    fabric.load(tmp_path / "reference.ckpt", {"loader": from_reference})
    assert [b.tolist() for b in from_reference] == expected
    assert isinstance(reference_side, stateful.StatefulDataLoader)
