"""fabric-bnb under real 2-process DDP (gloo, ranks started as torchrun starts them): frozen NF4 or LLM.int8 base
weights with trainable LoRA adapters, and int8 training, stay in sync, reduce the loss, and a quantized checkpoint
saved by DDP loads back bit-exactly on every rank."""

from __future__ import annotations

import json
import textwrap

import pytest
from jobs import run_ranks

pytest.importorskip("bitsandbytes", reason="fabric-bnb's tests need bitsandbytes (pip install fabric-bnb)")
pytest.importorskip("fabric_ddp", reason="the DDP checks need fabric-ddp")

SCRIPT = textwrap.dedent(
    """
    import json, sys

    import bitsandbytes as bnb
    import torch
    from torch import nn

    from fabric_core import Fabric

    mode, folder = sys.argv[1], sys.argv[2]


    class LoRA(nn.Module):
        def __init__(self, base, rank=4):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + x @ self.a.t() @ self.b.t()


    def build(fabric):
        torch.manual_seed(0)  # the same pretrained base on every rank
        with fabric.init_module():
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
        if mode in ("nf4", "int8"):  # frozen quantized base weights: train adapters beside them
            model[0], model[2] = LoRA(model[0]), LoRA(model[2])
        trainable = [p for p in model.parameters() if p.requires_grad]
        return fabric.setup(model, bnb.optim.AdamW8bit(trainable, lr=3e-2, min_8bit_size=16))


    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, precision="bnb-" + mode)
    fabric.launch()
    model, optimizer = build(fabric)
    base_before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("base.weight")}
    g = torch.Generator().manual_seed(100 + fabric.global_rank)  # each rank its own data
    x = torch.randn(64, 32, generator=g)
    y = (x[:, :8] * 2).sin()
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    trainable = torch.cat([p.detach().float().flatten() for p in model.parameters() if p.requires_grad])
    gathered = fabric.all_gather(trainable)
    base = model.module[0].base.weight if mode in ("nf4", "int8") else model.module[0].weight
    bases = fabric.all_gather(base.detach().float().flatten())
    fabric.save(folder + "/ckpt.pt", {"model": model, "optimizer": optimizer})
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt = build(fabric)
    fabric.load(folder + "/ckpt.pt", {"model": fresh, "optimizer": fresh_opt})
    loaded = fresh.state_dict()
    exact = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    layers = sorted(type(m).__name__ for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)))
    print("RESULT " + json.dumps({
        "rank": fabric.global_rank,
        "first": losses[0], "last": losses[-1],
        "in_sync": bool(torch.equal(gathered[0], gathered[1])),
        "bases_equal": bool(torch.equal(bases[0], bases[1])),
        "exact": exact,
        "frozen": bool(base_before) and all(torch.equal(v, model.state_dict()[k]) for k, v in base_before.items()),
        "layers": layers,
    }))
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("mode", "layer"), [("nf4", "NF4Linear"), ("int8", "Int8InferenceLinear"), ("int8-training", "Int8TrainingLinear")]
)
def test_ddp_two_processes(tmp_path, mode, layer):
    script = tmp_path / "bnb_ddp.py"
    script.write_text(SCRIPT)
    outputs = run_ranks(script, mode, str(tmp_path), world_size=2, timeout=240, tmp_path=tmp_path)
    results = [json.loads(line[len("RESULT ") :]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2, outputs
    for result in results:
        assert result["layers"] == [layer] * 3
        assert result["in_sync"] and result["bases_equal"], result
        assert result["exact"], result
        assert result["frozen"] is (mode != "int8-training"), result  # quantized bases do not move; adapters train
        assert result["last"] < 0.8 * result["first"], result
