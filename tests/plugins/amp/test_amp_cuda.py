"""The real CUDA path: ``precision="16-mixed"`` chosen by name builds a CUDA ``GradScaler`` (no CPU fallback)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric_amp import MixedPrecision
from fabric_core import Fabric

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: checks the CUDA autocast + GradScaler path"
    ),
]


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.seen["linear_dtype"] = y.dtype
        self.seen["autocast"] = torch.is_autocast_enabled("cuda")
        return y


def _setup(precision: str = "16-mixed"):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    assert not [w for w in record if "AMP" in str(w.message)]
    torch.manual_seed(0)
    probe = Probe()
    reference = copy.deepcopy(probe).cuda()
    model, optimizer = fabric.setup(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
    return fabric, fabric._precision, probe, model, optimizer, reference


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g).cuda(), torch.randn(16, 1, generator=g).cuda()


def test_16_mixed_on_cuda_scales_with_a_cuda_grad_scaler():
    fabric, precision, probe, model, optimizer, reference = _setup()
    assert isinstance(precision, MixedPrecision)
    assert precision.precision == "16-mixed" and precision.device == "cuda"
    assert isinstance(precision.scaler, torch.amp.GradScaler) and precision.scaler.is_enabled()
    scale = precision.scaler.get_scale()

    x, y = _batch()
    out = model(x)
    assert probe.seen == {"linear_dtype": torch.float16, "autocast": True}
    assert out.dtype == torch.float32
    fabric.backward(F.mse_loss(out, y))
    assert probe.linear.weight.grad.dtype == torch.float32

    with torch.autocast("cuda", dtype=torch.float16):
        ref_out = reference(x)
    F.mse_loss(ref_out.float(), y).backward()
    torch.testing.assert_close(
        probe.linear.weight.grad, scale * reference.linear.weight.grad, rtol=1e-3, atol=1e-2
    )

    norm = fabric.clip_gradients(model, optimizer, max_norm=1e6)  # unscales on the GPU
    torch.testing.assert_close(
        norm,
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.parameters()])),
        rtol=1e-3,
        atol=1e-6,
    )
    optimizer.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(probe.linear.weight, reference.linear.weight, rtol=1e-4, atol=1e-6)


def test_16_mixed_on_cuda_skips_non_finite_steps(tmp_path):
    fabric, precision, probe, model, optimizer, _ = _setup()
    scale = precision.scaler.get_scale()
    x, y = _batch()
    fabric.backward(F.mse_loss(model(x), y))
    probe.linear.weight.grad[0, 0] = float("inf")
    before = probe.linear.weight.detach().clone()
    optimizer.step()
    assert torch.equal(probe.linear.weight, before)
    assert precision.scaler.get_scale() == scale / 2

    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    fresh = MixedPrecision("16-mixed", device="cuda")
    fabric2 = Fabric(accelerator="cuda", devices=1, plugins=[fresh])
    model2 = Probe()
    model2, optimizer2 = fabric2.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    fabric2.load(tmp_path / "ckpt.pt", {"model": model2, "optimizer": optimizer2})
    assert fresh.scaler.get_scale() == scale / 2


def test_bf16_mixed_on_cuda_has_no_scaler():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 support")
    fabric, precision, probe, model, optimizer, _ = _setup("bf16-mixed")
    assert precision.scaler is None
    x, y = _batch()
    out = model(x)
    assert probe.seen == {"linear_dtype": torch.bfloat16, "autocast": True}
    assert out.dtype == torch.float32
    fabric.backward(F.mse_loss(out, y))
    optimizer.step()
    assert probe.linear.weight.dtype == torch.float32
