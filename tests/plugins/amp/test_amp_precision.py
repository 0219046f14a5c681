"""fabric-amp on CPU: names, autocast in forward, fp32 master weights, the CPU fallback, the backward guard."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from fabric_amp import MixedPrecision
from fabric_core import Fabric
from fabric_core.plugins import get_registry

FP16_ON_CPU = (
    "You passed `Fabric(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU."
    " Using `precision='bf16-mixed'` instead."
)


class Probe(nn.Module):
    """Records what the forward pass saw: input dtype, autocast state, the dtype a Linear produced."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["input_dtype"] = x.dtype
        self.seen["autocast"] = torch.is_autocast_enabled("cpu")
        self.seen["autocast_dtype"] = torch.get_autocast_dtype("cpu")
        y = self.linear(x)
        self.seen["linear_dtype"] = y.dtype
        return y


def _precision_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message) for w in record if "precision" in str(w.message).lower() or "AMP" in str(w.message)
    ]


# ------------------------------------------------------------------------------------------------ registration


def test_names_are_registered_by_fabric_amp():
    registry = get_registry()
    for name in ("16-mixed", "bf16-mixed"):
        entry = registry.get("precision", name)
        assert entry.distribution == "fabric-amp"
        assert entry.load() is MixedPrecision
        assert entry.init_kwargs == {"precision": name}
    assert registry.get("precision", "16").name == "16-mixed"
    assert registry.get("precision", "bf16").name == "bf16-mixed"


def test_registration_module_does_not_import_torch():
    code = (
        "import sys, fabric_amp.register, fabric_amp\n"
        "heavy = [m for m in ('torch', 'fabric_amp.precision') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ------------------------------------------------------------------------------------------------ bf16-mixed


def test_bf16_mixed_autocasts_forward_and_keeps_fp32_master_weights():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    assert isinstance(fabric._precision, MixedPrecision)
    assert fabric._precision.scaler is None
    probe = Probe()
    model, optimizer = fabric.setup(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # convert_module is the identity

    x = torch.randn(5, 8)
    out = model(x)
    assert probe.seen == {
        "input_dtype": torch.bfloat16,  # floating inputs are cast to the autocast dtype before forward
        "autocast": True,
        "autocast_dtype": torch.bfloat16,
        "linear_dtype": torch.bfloat16,
    }
    assert out.dtype == torch.float32  # cast back to the default dtype
    assert not torch.is_autocast_enabled("cpu")  # the context ended with the forward

    fabric.backward(out.square().mean())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    before = probe.linear.weight.detach().clone()
    optimizer.step()
    assert probe.linear.weight.dtype == torch.float32
    assert not torch.equal(before, probe.linear.weight)


def test_integer_and_bool_inputs_are_not_cast():
    class Inputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x, index, mask):
            self.dtypes = (x.dtype, index.dtype, mask.dtype)
            return self.linear(x)

    fabric = Fabric(accelerator="cpu", precision="16-mixed")  # falls back to bf16-mixed on the CPU
    module = Inputs()
    model = fabric.setup(module)
    model(torch.randn(3, 2), index=torch.arange(3), mask=torch.ones(3, dtype=torch.bool))
    assert module.dtypes == (torch.bfloat16, torch.int64, torch.bool)


def test_output_collections_are_cast_back_and_non_floats_untouched():
    class Many(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            y = self.linear(x)
            return {"y": y, "pair": (y * 2, torch.arange(3)), "flag": torch.tensor([True])}

    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    out = fabric.setup(Many())(torch.randn(2, 3))
    assert out["y"].dtype == torch.float32
    assert out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64
    assert out["flag"].dtype == torch.bool


def test_fabric_autocast_is_the_forward_context():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with fabric.autocast():
        assert torch.is_autocast_enabled("cpu")
        inside = a @ b
    outside = a @ b
    assert inside.dtype == torch.bfloat16
    assert outside.dtype == torch.float32
    torch.testing.assert_close(inside.float(), outside, atol=0.1, rtol=0.05)


def test_init_contexts_keep_float32():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    with fabric.init_module():
        layer = nn.Linear(2, 2)
    with fabric.init_tensor():
        t = torch.zeros(2)
    assert layer.weight.dtype == torch.float32
    assert t.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ 16-mixed on CPU


def test_16_mixed_on_cpu_falls_back_to_bf16_with_a_warning():
    with pytest.warns(UserWarning, match=FP16_ON_CPU.replace("(", r"\(").replace(")", r"\)")):
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
    precision = fabric._precision
    assert isinstance(precision, MixedPrecision)
    assert precision.precision == "bf16-mixed"
    assert precision.dtype == torch.bfloat16
    assert precision.scaler is None
    assert "precision='bf16-mixed'" in repr(fabric)
    probe = Probe()
    fabric.setup(probe)(torch.randn(2, 8))
    assert probe.seen["linear_dtype"] == torch.bfloat16


def test_explicit_cpu_device_keeps_fp16_and_a_scaler():
    precision = MixedPrecision("16-mixed", device="cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fabric = Fabric(accelerator="cpu", plugins=[precision])
    assert _precision_warnings(record) == []
    assert fabric._precision is precision
    assert precision.precision == "16-mixed"
    assert isinstance(precision.scaler, torch.amp.GradScaler)
    probe = Probe()
    fabric.setup(probe)(torch.randn(2, 8))
    assert probe.seen["autocast_dtype"] == torch.float16
    assert probe.seen["linear_dtype"] == torch.float16


@pytest.mark.parametrize(
    ("value", "canonical", "expected"),
    [
        (16, "16-mixed", ["`precision=16` is supported for historical reasons", FP16_ON_CPU]),
        ("16", "16-mixed", ["`precision=16` is supported for historical reasons", FP16_ON_CPU]),
        ("bf16", "bf16-mixed", ["`precision=bf16` is supported for historical reasons"]),
        ("bf16-mixed", "bf16-mixed", []),
    ],
)
def test_legacy_aliases_warn(value, canonical, expected):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fabric = Fabric(accelerator="cpu", precision=value)
    messages = _precision_warnings(record)
    assert len(messages) == len(expected), messages
    for message, start in zip(messages, expected):
        assert message.startswith(start)
    if expected and value != "bf16-mixed":
        assert f"Please set your precision to {canonical} instead!" in messages[0]
    assert fabric._precision.precision == "bf16-mixed"  # 16 falls back on CPU too


# ------------------------------------------------------------------------------------------------ backward guard


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed-cpu"])
def test_plain_loss_backward_is_refused(precision):
    plugin = MixedPrecision("16-mixed", device="cpu") if precision == "16-mixed-cpu" else None
    fabric = Fabric(accelerator="cpu", **({"plugins": [plugin]} if plugin else {"precision": precision}))
    model = fabric.setup(nn.Linear(3, 1))
    loss = model(torch.randn(4, 3)).sum()
    with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)` instead of"):
        loss.backward()
    loss = model(torch.randn(4, 3)).sum()
    fabric.backward(loss)
    assert model.weight.grad is not None


def test_true_precisions_do_not_guard_backward():
    fabric = Fabric(accelerator="cpu", precision="bf16-true")
    model = fabric.setup(nn.Linear(3, 1))
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None


# ------------------------------------------------------------------------------------------------ bad input


def test_constructor_errors():
    with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
        MixedPrecision("bf16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"Precision must be '16-mixed' or 'bf16-mixed'"):
        MixedPrecision("16-true")
    with pytest.raises(TypeError, match="must be a `torch.amp.GradScaler`"):
        MixedPrecision("16-mixed", scaler=object())  # type: ignore[arg-type]


def test_explicit_device_must_match_the_accelerator():
    with pytest.raises(ValueError, match=r"`MixedPrecision\(device='cuda'\)` does not match the accelerator"):
        Fabric(accelerator="cpu", plugins=[MixedPrecision("bf16-mixed", device="cuda")])


def test_forward_context_needs_a_device():
    with pytest.raises(RuntimeError, match="does not know its device yet"):
        MixedPrecision("bf16-mixed").forward_context()


def test_strategy_chosen_explicitly_gets_the_same_precision():
    fabric = Fabric(accelerator="cpu", strategy="single_device", precision="bf16-mixed")
    assert isinstance(fabric._strategy.precision, MixedPrecision)
    assert fabric._strategy.precision is fabric._precision
    assert fabric._strategy.requires_fabric_backward
