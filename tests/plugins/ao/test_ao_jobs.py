"""fabric-ao in real processes: float8 under 2-process FSDP2 (gloo, float8 all-gather, scales precomputed after each
step, sharded checkpoint round trip), and torchao's 8-bit AdamW through setup/save/load.

torchao's low-bit optimizers compile their step with inductor (~20 s cold): each job gets a fresh
``TORCHINDUCTOR_CACHE_DIR`` (a shared cache mixed up the 8-bit and 4-bit kernels, measured here), and there is one
such job only."""

from __future__ import annotations

import json
import textwrap

import pytest
from jobs import run_ranks, run_script

pytest.importorskip("torchao", reason="fabric-ao's tests need torchao (pip install fabric-ao)")

FSDP_SCRIPT = textwrap.dedent(
    """
    import json, sys

    import torch
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from fabric_ao import Float8Precision
    from fabric_core import Fabric

    folder = sys.argv[1]


    def build(fabric):
        torch.manual_seed(0)
        with fabric.init_module(empty_init=False):
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return fabric.setup(model, optimizer)


    def full_state(fabric, model):
        from torch.distributed.tensor import DTensor

        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
                for k, v in model.state_dict().items()}


    precision = Float8Precision(enable_fsdp_float8_all_gather=True)
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=precision)
    fabric.launch()
    model, optimizer = build(fabric)
    g = torch.Generator().manual_seed(10 + fabric.global_rank)
    x = torch.randn(64, 32, generator=g)
    y = (x[:, :16] * 2).sin()
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    float8 = sum(isinstance(m, Float8Linear) for m in model.modules())
    weight = model.module[0].weight
    fabric.save(folder + "/ckpt", {"model": model, "optimizer": optimizer})
    before = full_state(fabric, model)
    with torch.no_grad():
        out = model(x)
    fresh, fresh_opt = build(fabric)
    fabric.load(folder + "/ckpt", {"model": fresh, "optimizer": fresh_opt})
    after = full_state(fabric, fresh)
    with torch.no_grad():
        out_after = fresh(x)
    print("RESULT " + json.dumps({
        "first": losses[0], "last": losses[-1], "float8": float8,
        "weight_type": type(weight).__name__,
        "inner": type(getattr(weight, "_local_tensor", weight)).__name__,
        "exact": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
        "same_output": bool(torch.equal(out, out_after)),
    }))
    """
)


@pytest.mark.multiprocess
def test_float8_with_fsdp_two_processes(tmp_path):
    pytest.importorskip("fabric_fsdp", reason="the FSDP check needs fabric-fsdp")
    script = tmp_path / "ao_fsdp.py"
    script.write_text(FSDP_SCRIPT)
    outputs = run_ranks(script, str(tmp_path), world_size=2, timeout=300, tmp_path=tmp_path)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2, outputs
    for result in results:
        assert result["float8"] == 3, result
        # FSDP2 shards the float8 weight wrapper: a DTensor whose local shard all-gathers in float8
        assert result["weight_type"] == "DTensor" and result["inner"] == "WeightWithDynamicFloat8CastTensor", result
        assert result["last"] < 0.6 * result["first"], result
        assert result["exact"] and result["same_output"], result


OPTIM_SCRIPT = textwrap.dedent(
    """
    import json, sys

    import torch
    from torch import nn
    from torchao.optim import AdamW8bit

    from fabric_core import Fabric

    folder = sys.argv[1]


    def build(fabric):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16))
        # block size 256: tensors of at least 4096 elements get 8-bit state (both weights here)
        return fabric.setup(model, AdamW8bit(model.parameters(), lr=1e-2, block_size=256))


    def step(fabric, model, optimizer, x, y):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        return loss.item()


    def states(optimizer):
        out = {}
        for index, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                parts = {"codes": value.codes, "scale": value.scale} if hasattr(value, "codes") else {"value": value}
                for part, tensor in parts.items():
                    out[f"{index}.{name}.{part}"] = (type(value).__name__, tensor.clone())
        return out


    fabric = Fabric(accelerator="cpu")
    model, optimizer = build(fabric)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=g)
    y = (x[:, :16] * 2).sin()
    losses = [step(fabric, model, optimizer, x, y) for _ in range(20)]
    fabric.save(folder + "/ckpt.pt", {"model": model, "optimizer": optimizer})
    saved = states(optimizer)
    fresh, fresh_opt = build(fabric)
    fabric.load(folder + "/ckpt.pt", {"model": fresh, "optimizer": fresh_opt})  # the safe (weights_only) loader
    loaded = states(fresh_opt)
    exact = saved.keys() == loaded.keys() and all(
        saved[k][0] == loaded[k][0] and torch.equal(saved[k][1], loaded[k][1]) for k in saved
    )
    # one more step from the saved and from the loaded state: the same parameters
    step(fabric, model, optimizer, x, y)
    step(fabric, fresh, fresh_opt, x, y)
    resumed = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    print("RESULT " + json.dumps({
        "first": losses[0], "last": losses[-1], "exact": exact, "resumed": resumed,
        "kinds": sorted({kind for kind, _ in saved.values()}),
    }))
    """
)


@pytest.mark.multiprocess
def test_torchao_8bit_adamw_through_setup_save_and_load(tmp_path):
    script = tmp_path / "ao_optim.py"
    script.write_text(OPTIM_SCRIPT)
    out = run_script(
        script, str(tmp_path), timeout=400, tmp_path=tmp_path, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    )
    result = next(json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT "))
    assert "OptimState8bit" in result["kinds"], result  # the quantized tensor-subclass state, not a float copy
    assert result["last"] < 0.5 * result["first"], result
    assert result["exact"] and result["resumed"], result
