"""bitsandbytes' paged 8-bit optimizer through Fabric on the CPU, as the README says: it falls back to the
non-paged behaviour (with bitsandbytes' own warning), trains exactly as ``AdamW8bit`` does in a plain loop, keeps
8-bit state, and that state round-trips through ``fabric.save``/``fabric.load``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes", reason="fabric-bnb's tests need bitsandbytes (pip install fabric-bnb)")

from fabric_core import Fabric  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def test_paged_adamw8bit_on_the_cpu_trains_like_adamw8bit_and_round_trips(tmp_path):
    model = _model()
    reference = copy.deepcopy(model)
    fabric = Fabric(accelerator="cpu", precision="32-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = fabric.setup(model, bnb.optim.PagedAdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=16))
        x, y = _batch()
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    assert any("Paged optimizers are not supported on CPU" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert optimizer.optimizer.is_paged
    # the reference: the library's non-paged AdamW8bit in a plain torch loop, same model, same batches
    expected_opt = bnb.optim.AdamW8bit(reference.parameters(), lr=1e-2, min_8bit_size=16)
    expected = []
    for _ in range(5):
        expected_opt.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        expected_opt.step()
        expected.append(loss.item())
    assert losses == expected and losses[-1] < 0.3 * losses[0], (losses, expected)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    state = optimizer.optimizer.state[model.module[0].weight]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8 and state["step"] == 5

    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    fresh = _model()
    fresh, fresh_opt = fabric.setup(fresh, bnb.optim.PagedAdamW8bit(fresh.parameters(), lr=1e-2, min_8bit_size=16))
    fabric.load(tmp_path / "ckpt.pt", {"model": fresh, "optimizer": fresh_opt})  # the safe (weights_only) loader
    loaded = fresh_opt.optimizer.state[fresh.module[0].weight]
    for key in ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"):
        assert torch.equal(loaded[key], state[key]), key
    # one more step from the saved and from the loaded state: the same weights, to the bit
    for m, opt in ((model, optimizer), (fresh, fresh_opt)):
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(m(x), y))
        opt.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
