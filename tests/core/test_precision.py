"""Core precision plugins (32-true, 64-true, 16-true, bf16-true) and the loss.backward() guard."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.plugins import reset_registry
from fabric_core.precision import DoublePrecision, HalfPrecision, Precision
from fabric_core.strategies.base import PRECISION_STATE_KEY
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_core.utilities.rank_zero import set_rank


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in ("FABRIC_PLUGINS", "FABRIC_CLI_USED", "FABRIC_PRECISION"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    dtype = torch.get_default_dtype()
    yield
    reset_registry()
    assert torch.get_default_dtype() == dtype


class NeedsFabricBackward(Precision):
    """A precision that must see the loss before backward (as loss scaling does)."""

    def __init__(self) -> None:
        self.pre_backward_calls = 0

    def pre_backward(self, tensor, module):
        self.pre_backward_calls += 1
        return tensor * 1.0


class StatefulPrecision(Precision):
    """A precision with state (like a GradScaler) that checkpoints must carry."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.device_type = None

    def configure(self, device_type: str) -> None:
        self.device_type = device_type

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state_dict):
        self.scale = state_dict["scale"]


# ---------------------------------------------------------------------------------------------------- plugins alone


def test_full_precision_is_a_no_op():
    precision = Precision()
    module = nn.Linear(2, 2)
    assert precision.precision == "32-true"
    assert precision.convert_module(module) is module
    for context in (precision.forward_context(), precision.tensor_init_context(), precision.module_init_context()):
        assert isinstance(context, nullcontext)
    data = {"x": torch.ones(1, dtype=torch.float64)}
    assert precision.convert_input(data) is data
    assert precision.convert_output(data) is data
    assert precision.requires_fabric_backward is False
    assert precision.state_dict() == {}


def test_double_precision():
    precision = DoublePrecision()
    assert precision.precision == "64-true"
    module = nn.Linear(2, 2)
    assert precision.convert_module(module) is module
    assert module.weight.dtype == torch.float64
    for make in (precision.forward_context, precision.tensor_init_context, precision.module_init_context):
        with make():
            assert torch.get_default_dtype() == torch.float64
            assert torch.ones(1).dtype == torch.float64
            assert torch.ones(1, dtype=torch.float32).dtype == torch.float32
            assert torch.arange(2).dtype == torch.int64
        assert torch.get_default_dtype() == torch.float32
    data = {"f": torch.ones(1), "i": torch.ones(1, dtype=torch.int32), "b": [torch.ones(1, dtype=torch.bool), "s"]}
    converted = precision.convert_input(data)
    assert converted["f"].dtype == torch.float64
    assert converted["i"].dtype == torch.int32 and converted["b"][0].dtype == torch.bool and converted["b"][1] == "s"
    assert data["f"].dtype == torch.float32  # input not modified
    assert precision.convert_output(converted)["f"].dtype == torch.float32
    assert precision.requires_fabric_backward is False


def test_contexts_nest_and_restore_after_errors():
    double = DoublePrecision()
    half = HalfPrecision("bf16-true")
    with double.forward_context():
        with half.forward_context():
            assert torch.get_default_dtype() == torch.bfloat16
        assert torch.get_default_dtype() == torch.float64
    with pytest.raises(KeyError), double.module_init_context():
        raise KeyError("boom")
    assert torch.get_default_dtype() == torch.float32
    context = double.forward_context()  # one context object used twice, nested
    with context:
        with context:
            assert torch.get_default_dtype() == torch.float64
        assert torch.get_default_dtype() == torch.float64
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("name", "dtype"), [("16-true", torch.float16), ("bf16-true", torch.bfloat16)])
def test_half_precision(name, dtype):
    precision = HalfPrecision(name)
    assert precision.precision == name
    module = precision.convert_module(nn.Linear(2, 2))
    assert module.weight.dtype == dtype
    with precision.module_init_context():
        assert nn.Linear(1, 1).weight.dtype == dtype
    assert precision.convert_input(torch.ones(1)).dtype == dtype
    assert precision.convert_output(torch.ones(1, dtype=dtype)).dtype == torch.float32
    assert precision.requires_fabric_backward is False


def test_half_precision_rejects_other_names():
    with pytest.raises(ValueError, match="HalfPrecision supports"):
        HalfPrecision("16-mixed")


# ---------------------------------------------------------------------------------------------------- through Fabric


def test_64_true_training_step():
    fabric = Fabric(precision="64-true")
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    out = model(torch.randn(4, 3))
    assert out.dtype == torch.float32
    out.sum().backward()  # 64-true needs no fabric.backward
    assert model.weight.grad.dtype == torch.float64
    optimizer.step()
    assert model.weight.dtype == torch.float64
    with fabric.init_module():
        assert nn.Linear(1, 1).weight.dtype == torch.float64


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_true_through_fabric(precision):
    fabric = Fabric(precision=precision)
    model = fabric.setup(nn.Linear(3, 2))
    out = model(torch.randn(4, 3))
    assert out.dtype == torch.float32
    assert model.weight.dtype == fabric.strategy.precision.input_dtype
    with fabric.init_tensor():
        assert torch.empty(1).dtype == fabric.strategy.precision.input_dtype
    with fabric.autocast():
        assert torch.get_default_dtype() == fabric.strategy.precision.input_dtype


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true", "16-true"])
def test_plain_backward_allowed_for_true_precisions(precision):
    fabric = Fabric(precision=precision)
    model = fabric.setup(nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
    assert fabric.strategy.requires_fabric_backward is False


def test_plain_backward_refused_when_the_precision_needs_fabric_backward():
    precision = NeedsFabricBackward()
    fabric = Fabric(plugins=precision)
    assert precision.requires_fabric_backward is True
    model = fabric.setup(nn.Linear(2, 1))
    with pytest.raises(RuntimeError, match="requires you to call `fabric.backward\\(loss\\)` instead of `loss.backward\\(\\)`"):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is None
    fabric.backward(model(torch.ones(1, 2)).sum())
    assert precision.pre_backward_calls == 1
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
    # outputs that do not require grad are left alone
    with torch.no_grad():
        assert model(torch.ones(1, 2)).requires_grad is False
    # after fabric.backward the guard is armed again
    with pytest.raises(RuntimeError, match="fabric.backward"):
        model(torch.ones(1, 2)).sum().backward()


def test_plain_backward_refused_when_the_strategy_owns_backward():
    class OwnBackward(SingleDeviceStrategy):
        def backward(self, tensor, module, *args, **kwargs):
            super().backward(tensor, module, *args, **kwargs)

    fabric = Fabric(strategy=OwnBackward())
    model = fabric.setup(nn.Linear(2, 1))
    with pytest.raises(RuntimeError, match="fabric.backward"):
        model(torch.ones(1, 2)).sum().backward()
    fabric.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None


def test_precision_plugin_is_configured_and_checkpointed(tmp_path):
    precision = StatefulPrecision()
    fabric = Fabric(plugins=precision)
    assert precision.device_type == "cpu"
    model = fabric.setup(nn.Linear(1, 1))
    precision.scale = 128.0
    fabric.save(tmp_path / "ckpt.pt", {"model": model}).wait()  # durable at the path before reading it directly
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert raw[PRECISION_STATE_KEY] == {"scale": 128.0}
    precision.scale = 1.0
    remainder = fabric.load(tmp_path / "ckpt.pt", {"model": model})
    assert precision.scale == 128.0
    assert remainder == {}  # the precision's entry is consumed, not handed to the user
    assert PRECISION_STATE_KEY in fabric.load(tmp_path / "ckpt.pt")  # a full read returns everything


def test_no_precision_entry_for_stateless_precisions(tmp_path):
    fabric = Fabric(precision="64-true")
    fabric.save(tmp_path / "ckpt.pt", {"model": fabric.setup(nn.Linear(1, 1))}).wait()  # durable at the path before reading it directly
    assert set(torch.load(tmp_path / "ckpt.pt", weights_only=True)) == {"model"}
