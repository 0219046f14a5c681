"""``fabric.forward_backward``: the core's default step (micro-batches through the model and ``fabric.backward``),
which strategies that run forward and backward together (pipelines) replace; tested on one device here, and on
``model_parallel``'s pipeline and sequence axes in tests/plugins/fsdp/test_pipeline_sequence.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_core import Fabric


def test_forward_backward_on_one_device_is_the_plain_loop() -> None:
    """The core's default: micro-batches through forward and backward, the loss of the whole batch."""
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model, reference = nn.Linear(3, 2), nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    model = fabric.setup_module(model)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    loss = fabric.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss, micro_batches=4)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    assert float(loss) == pytest.approx(ref_loss.item(), abs=1e-6) and not loss.requires_grad
    assert torch.allclose(model.weight.grad, reference.weight.grad, atol=1e-6)
    # no target: loss_fn(output)
    assert float(fabric.forward_backward(model, x, loss_fn=lambda out: out.sum())) == pytest.approx(reference(x).sum().item(), rel=1e-5)
    with pytest.raises(ValueError, match="batch has 8 samples. Use a batch size divisible by 3"):
        fabric.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss, micro_batches=3)
    with pytest.raises(TypeError, match="must return the loss as a tensor with one element"):
        fabric.forward_backward(model, x, target=y, loss_fn=lambda out, t: out - t)
    with pytest.raises(TypeError, match="needs the model returned by `fabric.setup"):
        fabric.forward_backward(reference, x, target=y, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match="`micro_batches` must be a positive integer, got 0"):
        fabric.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss, micro_batches=0)
