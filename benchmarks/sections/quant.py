"""Quantized and float8 training (fabric-bnb, fabric-ao) on the CPU: weight memory, quality, steps/s.

* Memory: a 4-layer Transformer (d=1024, explicit Linear layers) built under ``fabric.init_module(empty_init=True)``
  with ``bnb-nf4`` / ``bnb-int8``; the bytes its Linear weights occupy (packed data + quantization statistics)
  over the same weights in bfloat16.
* Quality: the demo's corpus (standard-library source, bytes) and a small byte-level Transformer of explicit Linear
  layers, pre-trained in float32 for a few steps; then LoRA adapters (rank 8, on every Linear of the blocks)
  trained with bitsandbytes' 8-bit AdamW over a frozen base in bfloat16 (``bf16-true``) and in NF4 (``bnb-nf4``):
  final loss of NF4 over bf16. And pre-training from scratch with ``float8`` (torchao, emulated on the CPU) against
  ``bf16-mixed``: final loss of float8 over bf16-mixed.
* Speed: steps/s of each run (process CPU time, one intra-op thread); float8 emulation is expected to be slower
  than bf16 on a CPU (the casts are extra work, the matmul is not faster).
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from benchmarks._common import REPO_ROOT, dist_version, summarize
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

VARIANTS = ("bf16", "nf4", "int8")


def _demo_corpus() -> bytes:
    spec = importlib.util.spec_from_file_location("_demo_lm", REPO_ROOT / "examples" / "demo" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_corpus()[0]


def _model_classes():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class LM(nn.Module):
        def __init__(self, d: int, layers: int, heads: int, seq: int) -> None:
            super().__init__()
            self.embed, self.pos = nn.Embedding(256, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, 256)

        def forward(self, idx):
            x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    class LoRA(nn.Module):
        def __init__(self, base: nn.Module, rank: int) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features, dtype=torch.float32) / base.in_features**0.5)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32))

        def forward(self, x):
            return self.base(x) + (x @ self.a.to(x.dtype).t() @ self.b.to(x.dtype).t())

    return LM, LoRA


def _weight_bytes(model) -> int:
    import bitsandbytes as bnb
    import torch

    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.data.numel() * m.weight.data.element_size()
            state = getattr(m.weight, "quant_state", None)
            if state is not None:
                total += sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values())
            if isinstance(m, bnb.nn.Linear8bitLt):
                scb = m.weight.SCB if m.weight.SCB is not None else m.state.SCB
                total += scb.numel() * scb.element_size()
    return total


def _memory(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fabric_core import Fabric

    LM, _ = _model_classes()
    out = {}
    for variant, precision in (("bf16", "bf16-true"), ("nf4", "bnb-nf4"), ("nf4-dq", "bnb-nf4-dq"), ("int8", "bnb-int8")):
        fabric = Fabric(accelerator="cpu", precision=precision)
        with fabric.init_module(empty_init=True):
            model = LM(cfg["mem_d"], cfg["mem_layers"], 8, 64)
        out[variant] = _weight_bytes(model)
        del model
    torch.set_default_dtype(torch.float32)
    return {"bytes": out, "ratios": {v: out[v] / out["bf16"] for v in out if v != "bf16"}}


def _batches(data, seq: int, batch: int, steps: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
        yield window[:, :-1], window[:, 1:]


def _train(fabric, model, optimizer, data, cfg, steps: int, seed: int) -> tuple[list[float], float]:
    from torch import nn

    losses, start = [], time.process_time()
    for x, y in _batches(data, cfg["seq"], cfg["batch"], steps, seed):
        optimizer.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses, steps / (time.process_time() - start)


def _tail(losses: list[float], n: int) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def _quality(cfg: dict[str, Any], log) -> dict[str, Any]:
    import bitsandbytes as bnb
    import torch

    from fabric_core import Fabric

    LM, LoRA = _model_classes()
    data = torch.frombuffer(bytearray(_demo_corpus()), dtype=torch.uint8)
    dims = (cfg["d"], cfg["layers"], cfg["heads"], cfg["seq"])
    results: dict[str, Any] = {}

    # a "pretrained" base: a few float32 steps
    torch.manual_seed(0)
    base = LM(*dims)
    fabric = Fabric(accelerator="cpu")
    model, opt = fabric.setup(base, torch.optim.AdamW(base.parameters(), lr=3e-3))
    _train(fabric, model, opt, data, cfg, cfg["pretrain_steps"], seed=1)
    pretrained = {k: v.detach().clone() for k, v in base.state_dict().items()}

    for variant, precision in (("bf16", "bf16-true"), ("nf4", "bnb-nf4")):
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", precision=precision)
        model = LM(*dims)
        model.load_state_dict(pretrained)
        model.requires_grad_(False)
        for block in model.blocks:
            for name in ("qkv", "out", "up", "down"):
                setattr(block, name, LoRA(getattr(block, name), cfg["rank"]))
        model = fabric.setup_module(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = fabric.setup_optimizers(bnb.optim.AdamW8bit(params, lr=cfg["lora_lr"], min_8bit_size=1024))
        losses, rate = _train(fabric, model, opt, data, cfg, cfg["lora_steps"], seed=2)
        results[f"lora_{variant}"] = {"final": _tail(losses, cfg["tail"]), "first": losses[0], "steps_per_s": rate}
        log(f"  LoRA over {variant}: loss {losses[0]:.3f} -> {_tail(losses, cfg['tail']):.3f}, {rate:.2f} steps/s")

    for variant, precision in (("bf16-mixed", "bf16-mixed"), ("float8", "float8")):
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", precision=precision)
        model = LM(*dims)
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        losses, rate = _train(fabric, model, opt, data, cfg, cfg["scratch_steps"], seed=3)
        results[f"scratch_{variant}"] = {"final": _tail(losses, cfg["tail"]), "first": losses[0], "steps_per_s": rate}
        log(f"  from scratch, {variant}: loss {losses[0]:.3f} -> {_tail(losses, cfg['tail']):.3f}, {rate:.2f} steps/s")
    return results


def run(ctx: RunContext) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(ctx.options.get("threads", 1) or 1))
    cfg = dict(ctx.config)
    memory = _memory(cfg)
    ctx.log(f"  weight bytes over bf16: {memory['ratios']}")
    quality = _quality(cfg, ctx.log)
    ratios = {
        "nf4_weight_bytes": summarize([memory["ratios"]["nf4"]]),
        "int8_weight_bytes": summarize([memory["ratios"]["int8"]]),
        "qlora_final_loss": summarize([quality["lora_nf4"]["final"] / quality["lora_bf16"]["final"]]),
        "float8_final_loss": summarize([quality["scratch_float8"]["final"] / quality["scratch_bf16-mixed"]["final"]]),
        "qlora_speed": summarize([quality["lora_nf4"]["steps_per_s"] / quality["lora_bf16"]["steps_per_s"]]),
        "float8_speed": summarize([quality["scratch_float8"]["steps_per_s"] / quality["scratch_bf16-mixed"]["steps_per_s"]]),
    }
    return {
        "status": "ok",
        "config": cfg,
        "versions": {"bitsandbytes": dist_version("bitsandbytes"), "torchao": dist_version("torchao")},
        "memory": memory,
        "quality": quality,
        "ratios": ratios,
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg, mem, q, r = result["config"], result["memory"], result["quality"], result["ratios"]
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [
        f"### Quantized and float8 training on the CPU ({versions}; one intra-op thread)",
        "",
        f"Weight memory: a {cfg['mem_layers']}-layer Transformer, d={cfg['mem_d']}, built under"
        " `init_module(empty_init=True)`; bytes of its Linear weights including quantization statistics.",
        "",
        *table(
            ["precision", "Linear weight bytes", "over bf16"],
            [["bf16-true", f"{mem['bytes']['bf16']:,}", "1"]]
            + [[f"bnb-{v}", f"{mem['bytes'][v]:,}", f"{mem['ratios'][v]:.3f}"] for v in ("nf4", "nf4-dq", "int8")],
        ),
        "",
        f"Training on the demo's corpus (bytes of stdlib source), a {cfg['layers']}-layer byte LM, d={cfg['d']},"
        f" sequence {cfg['seq']}, batch {cfg['batch']}; loss = mean of the last {cfg['tail']} steps.",
        "",
        *table(
            ["run", "first loss", "final loss", "steps/s (CPU time)"],
            [
                [name, f"{q[key]['first']:.3f}", f"{q[key]['final']:.3f}", f"{q[key]['steps_per_s']:.2f}"]
                for name, key in (
                    (f"LoRA r{cfg['rank']} over a bf16 base, 8-bit AdamW, {cfg['lora_steps']} steps", "lora_bf16"),
                    (f"LoRA r{cfg['rank']} over an NF4 base (QLoRA), 8-bit AdamW, {cfg['lora_steps']} steps", "lora_nf4"),
                    (f"from scratch, bf16-mixed, {cfg['scratch_steps']} steps", "scratch_bf16-mixed"),
                    (f"from scratch, float8 (emulated), {cfg['scratch_steps']} steps", "scratch_float8"),
                )
            ],
        ),
        "",
        f"NF4 over bf16: final loss {stat(r['qlora_final_loss'], fixed=3)}, steps/s {stat(r['qlora_speed'], fixed=2)}."
        f" float8 over bf16-mixed: final loss {stat(r['float8_final_loss'], fixed=3)}, steps/s"
        f" {stat(r['float8_speed'], fixed=2)}. " + _speed_note(r["float8_speed"]["median"]),
    ]
    return "\n".join(lines)


def _speed_note(float8_over_bf16: float) -> str:
    """What the float8 speed ratio means on a CPU (emulation: float8 casts, then a float32 matmul)."""
    if float8_over_bf16 >= 1:
        return (
            "Emulated float8 was not slower here: its matmuls run in float32 while bf16-mixed's run under bfloat16"
            " autocast, which this CPU may not accelerate (a CPU with AVX512-BF16/AMX measured float8 emulation 3-4x"
            " slower than bf16-mixed,"
            " reference/measured-here.md). Emulation is for numerics, not speed; the speed-up needs a GPU with"
            " float8 matmuls (not measured: no GPU in this run)."
        )
    return (
        "Emulated float8 is slower on a CPU by design (float8 casts on top of a float32 matmul); the speed-up needs"
        " a GPU with float8 matmuls (not measured: no GPU in this run)."
    )


def _unavailable() -> str | None:
    missing = [d for d in ("fabric-bnb", "fabric-ao", "bitsandbytes", "torchao") if not dist_version(d)]
    return f"needs {', '.join(missing)} (make setup installs them)" if missing else None


_SETTINGS = {
    "mem_d": 1024, "mem_layers": 4, "d": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 8, "rank": 8,
    "pretrain_steps": 100, "lora_steps": 80, "lora_lr": 3e-3, "scratch_steps": 100, "tail": 15,
}  # fmt: skip

SECTION = Section(
    name="quant",
    order=70,
    modes={
        "full": _SETTINGS,
        "quick": {**_SETTINGS, "pretrain_steps": 40, "lora_steps": 30, "scratch_steps": 30, "tail": 10},
        "tiny": {**_SETTINGS, "mem_d": 64, "d": 32, "seq": 16, "batch": 2, "pretrain_steps": 2, "lora_steps": 2,
                 "scratch_steps": 2, "tail": 1},  # fmt: skip
    },
    run=run,
    render=render,
    isolated=True,
    unavailable=_unavailable,
    compares_lightning=False,
    timeout_s=1800,
    targets=(
        Target("nf4_memory", "NF4 Linear weight bytes / bf16", ("ratios",), "<=", 0.30, variant="nf4_weight_bytes", comparator=None),
        Target("int8_memory", "int8 Linear weight bytes / bf16", ("ratios",), "<=", 0.55, variant="int8_weight_bytes", comparator=None),
        Target("qlora_loss", "QLoRA final loss / LoRA over bf16", ("ratios",), "<=", 1.05, variant="qlora_final_loss", comparator=None),
        Target("float8_loss", "float8 (emulated) final loss / bf16-mixed", ("ratios",), "<=", 1.02, variant="float8_final_loss", comparator=None),
    ),
)
