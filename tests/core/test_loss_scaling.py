"""The core's LossScaling mixin with a real ``torch.amp.GradScaler`` on CPU, outside any plugin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_core.precision.base import Precision
from fabric_core.precision.loss_scaling import LossScaling


class ScalingPrecision(LossScaling, Precision):
    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.precision = "16-mixed" if scaler is not None else "bf16-mixed"
        self.scaler = scaler


def _step_parts(scale: float = 8.0):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = ScalingPrecision(torch.amp.GradScaler("cpu", init_scale=scale))
    return model, optimizer, precision


def test_scales_the_loss_and_unscales_once_before_the_step():
    model, optimizer, precision = _step_parts(scale=8.0)
    loss = model(torch.ones(2, 3)).sum()
    scaled = precision.pre_backward(loss, model)
    assert scaled.item() == pytest.approx(8.0 * loss.item())
    scaled.backward()
    scaled_grad = model.weight.grad.clone()
    precision.unscale_gradients(optimizer)
    precision.unscale_gradients(optimizer)  # clipping twice: a GradScaler alone would raise here
    assert torch.allclose(model.weight.grad, scaled_grad / 8.0)
    before = model.weight.detach().clone()
    precision.optimizer_step(optimizer)
    assert torch.allclose(model.weight, before - 0.1 * scaled_grad / 8.0)
    assert not precision._unscaled  # the next step unscales again


def test_a_step_with_inf_gradients_is_skipped_and_the_scale_drops():
    model, optimizer, precision = _step_parts(scale=8.0)
    precision.pre_backward(model(torch.ones(2, 3)).sum(), model).backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    precision.optimizer_step(optimizer)
    assert torch.equal(model.weight, before)
    assert precision.scaler.get_scale() < 8.0


def test_closure_and_lbfgs_are_refused_with_what_to_do():
    model, optimizer, precision = _step_parts()
    with pytest.raises(TypeError, match=r"does not support `optimizer.step\(closure\)`.*fabric.backward"):
        precision.optimizer_step(optimizer, closure=lambda: None)
    with pytest.raises(TypeError, match="LBFGS"):
        precision.optimizer_step(torch.optim.LBFGS(model.parameters()))


def test_state_round_trips_and_a_run_without_scaler_warns_instead_of_dropping_it_silently():
    _, _, precision = _step_parts(scale=64.0)
    state = precision.state_dict()
    assert state["scale"] == 64.0
    _, _, other = _step_parts(scale=2.0)
    other.load_state_dict(state)
    assert other.scaler.get_scale() == 64.0
    unscaled = ScalingPrecision(None)
    with pytest.warns(UserWarning, match="holds loss-scaler state.*the state is ignored"):
        unscaled.load_state_dict(state)
    assert unscaled.state_dict() == {}


def test_without_a_scaler_everything_passes_through():
    model, optimizer, _ = _step_parts()
    precision = ScalingPrecision(None)
    loss = model(torch.ones(2, 3)).sum()
    assert precision.pre_backward(loss, model) is loss
    loss.backward()
    grad = model.weight.grad.clone()
    precision.unscale_gradients(optimizer)
    assert torch.equal(model.weight.grad, grad)
    calls = []
    precision.optimizer_step(optimizer, closure=lambda: calls.append(1) or loss)
    assert calls == [1]
