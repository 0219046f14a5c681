"""16-mixed loss scaling with a real ``torch.amp.GradScaler`` on CPU (fp16 autocast, explicit device).

Every check compares against the same model trained without Fabric: fp16 autocast forward, an unscaled loss,
the same optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric_amp import MixedPrecision
from fabric_core import Fabric
from fabric_core.strategies.base import PRECISION_STATE_KEY


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)


def _setup(
    optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1), init_scale: float = 1024.0, growth_interval: int = 2000
):
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    precision = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", plugins=[precision])
    model = _model()
    reference = copy.deepcopy(model)
    wrapped, optimizer = fabric.setup(model, optimizer_fn(model.parameters()))
    return fabric, precision, wrapped, optimizer, reference, optimizer_fn(reference.parameters())


def _fabric_backward(fabric, model, step: int = 0) -> None:
    x, y = _batch(step)
    fabric.backward(F.mse_loss(model(x), y))


def _true_grads(reference: nn.Module, step: int = 0) -> list[torch.Tensor]:
    """Gradients of the unscaled loss, with the same fp16 autocast forward."""
    x, y = _batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = reference(x)
    reference.zero_grad()
    F.mse_loss(out.float(), y).backward()
    return [p.grad.clone() for p in reference.parameters()]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_all_close(actual, expected, **kw) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **kw)


def test_backward_scales_the_loss_and_step_unscales():
    fabric, precision, model, optimizer, reference, ref_optimizer = _setup()
    assert precision.scaler.get_scale() == 1024.0

    _fabric_backward(fabric, model)
    true = _true_grads(reference)
    assert any(g.abs().sum() > 0 for g in true)
    # atol: tiny unscaled fp16 gradients lose digits (that is what the scaling is for), the scaled ones do not.
    _assert_all_close(_grads(model), [1024.0 * g for g in true], rtol=1e-3, atol=1e-3)

    optimizer.step()
    ref_optimizer.step()  # the same SGD step with the true gradients
    _assert_all_close(_params(model), _params(reference), rtol=1e-4, atol=1e-6)
    assert precision.scaler.get_scale() == 1024.0


def test_scale_grows_after_growth_interval_good_steps():
    fabric, precision, model, optimizer, _, _ = _setup(growth_interval=2)
    for step in range(2):
        _fabric_backward(fabric, model, step)
        optimizer.step()
        optimizer.zero_grad()
    assert precision.scaler.get_scale() == 2048.0  # update() runs after every step


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradient_skips_the_step_and_halves_the_scale(bad):
    fabric, precision, model, optimizer, _, _ = _setup()
    _fabric_backward(fabric, model)
    next(model.parameters()).grad[0, 0] = bad
    before = _params(model)
    output = optimizer.step()
    assert output is None
    _assert_all_close(_params(model), before, rtol=0, atol=0)  # nothing moved
    assert precision.scaler.get_scale() == 512.0

    optimizer.zero_grad()
    _fabric_backward(fabric, model, step=1)
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(_params(model), before))
    assert precision.scaler.get_scale() == 512.0


def test_clipping_sees_true_gradients_and_unscales_once_per_step():
    fabric, precision, model, optimizer, reference, ref_optimizer = _setup()
    for step in range(2):  # the second step checks the per-step state was reset
        _fabric_backward(fabric, model, step)
        true = _true_grads(reference, step)
        expected_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in true]))

        norm = fabric.clip_gradients(model, optimizer, max_norm=1e6)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-3, atol=1e-6)
        _assert_all_close(_grads(model), true, rtol=1e-3, atol=1e-6)
        # A second clip in the same step must not divide by the scale again.
        assert fabric.clip_gradients(model, optimizer, clip_val=1e6) is None
        _assert_all_close(_grads(model), true, rtol=1e-3, atol=1e-6)

        optimizer.step()  # must not unscale again either
        optimizer.zero_grad()
        ref_optimizer.step()
        _assert_all_close(_params(model), _params(reference), rtol=1e-4, atol=1e-6)


def test_clipping_clips_the_unscaled_gradients():
    fabric, _, model, optimizer, reference, _ = _setup()
    _fabric_backward(fabric, model)
    true = _true_grads(reference)
    true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in true]))
    max_norm = float(true_norm) / 4
    norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm)
    torch.testing.assert_close(norm, true_norm, rtol=1e-3, atol=1e-6)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in _grads(model)]))
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-3, atol=1e-6)


def test_optimizer_that_unscales_itself():
    adam = lambda p: torch.optim.Adam(p, lr=0.01, fused=True)  # noqa: E731
    fabric, precision, model, optimizer, reference, _ = _setup(optimizer_fn=adam)
    assert optimizer.optimizer._step_supports_amp_scaling
    _fabric_backward(fabric, model)
    with pytest.raises(
        NotImplementedError,
        match="Gradient clipping is not implemented for optimizers handling the unscaling.",
    ):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)

    optimizer.step()  # the fused step receives the scale and unscales by itself
    _true_grads(reference)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    ref_optimizer.step()
    _assert_all_close(_params(model), _params(reference), rtol=1e-4, atol=1e-5)
    assert precision.scaler.get_scale() == 1024.0


def test_lbfgs_and_closures_are_refused():
    fabric, _, model, optimizer, _, _ = _setup()
    lbfgs = fabric.setup_optimizers(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="AMP and the LBFGS optimizer are not compatible."):
        lbfgs.step(lambda: 0.0)
    _fabric_backward(fabric, model)
    with pytest.raises(TypeError, match=r"does not support `optimizer.step\(closure\)`"):
        optimizer.step(lambda: 0.0)


def test_bf16_mixed_steps_closures_without_a_scaler():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.LBFGS(model.parameters(), max_iter=2))
    x, y = _batch()

    def closure():
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        return loss

    before = _params(model)
    loss = optimizer.step(closure)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(_params(model), before))


def test_scaler_state_round_trips_through_save_and_load(tmp_path):
    fabric, precision, model, optimizer, _, _ = _setup(growth_interval=3)
    for step in range(2):
        _fabric_backward(fabric, model, step)
        if step == 0:
            next(model.parameters()).grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
    saved_state = precision.scaler.state_dict()
    assert saved_state["scale"] == 512.0 and saved_state["_growth_tracker"] == 1

    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2}).wait()  # durable before reading directly
    raw = torch.load(path, weights_only=True)
    assert raw[PRECISION_STATE_KEY] == saved_state

    precision2 = MixedPrecision("16-mixed", device="cpu")
    assert precision2.scaler.get_scale() == 65536.0
    fabric2 = Fabric(accelerator="cpu", plugins=[precision2])
    model2 = _model()
    model2, optimizer2 = fabric2.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric2.load(path, state)
    assert remainder == {}
    assert state["step"] == 2
    assert precision2.scaler.state_dict() == saved_state
    _assert_all_close(_params(model2), _params(model), rtol=0, atol=0)

    # The restored growth tracker carries on: one more good step reaches growth_interval... of the loaded scaler.
    _fabric_backward(fabric2, model2, step=5)
    optimizer2.step()
    assert precision2.scaler.state_dict()["_growth_tracker"] == 2


def test_bf16_checkpoints_have_no_scaler_state_and_ignore_one(tmp_path):
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    model = fabric.setup(_model())
    path = tmp_path / "bf16.pt"
    fabric.save(path, {"model": model}).wait()
    assert PRECISION_STATE_KEY not in torch.load(path, weights_only=True)

    fp16, _, fp16_model, _, _, _ = _setup()
    fp16_path = tmp_path / "fp16.pt"
    fp16.save(fp16_path, {"model": fp16_model})
    with pytest.warns(UserWarning, match="holds loss-scaler state"):
        fabric.load(fp16_path, {"model": model})
