"""GPU benchmark: a GPT-2-small-sized model in plain PyTorch, bf16-mixed, raw loop vs fabric-core.

    python benchmarks/gpu_bench.py            # every section, a few minutes on one node
    python benchmarks/gpu_bench.py --quick    # one repetition each

Reports tokens/s and MFU (model FLOPs utilisation) for raw PyTorch vs ours on a single device (autocast,
fused AdamW), under DDP and under FSDP2 (``fully_shard`` per block, bf16 parameters, fp32 gradient
reduction), each over all visible GPUs and launched with torchrun. Sections whose plugin is not installed
(fabric-amp for all of them, fabric-ddp, fabric-fsdp) are skipped with the reason. Without CUDA the script says
so and exits with status 0. ``--cpu-dry-run`` runs every code path on the CPU with a tiny model (gloo), to check
the script itself on a machine without a GPU; its numbers mean nothing.

The raw and ours variants are interleaved (A B, B A, ...) and each gets the same initial weights and data. The
model computes its loss inside ``forward``, so in both variants the loss runs under the same autocast region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# the repository root, for `benchmarks._common` when run as a script
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks._common import (  # noqa: E402
    child_env,
    emit,
    module_available,
    paired_ratios,
    rotated,
    run_child,
    summarize,
)

#: Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment, first match wins; --peak-tflops overrides.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 6000 Ada", 364.0),
    ("4090", 165.0),
    ("3090", 71.0),
)


# ------------------------------------------------------------------------------------------------ model
def build_model(cfg: dict[str, int]) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, vocab: int, ctx: int, layers: int, heads: int, d: int) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.size(1), device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    torch.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["ctx"], cfg["layers"], cfg["heads"], cfg["d"])
    model.block_class = Block  # type: ignore[attr-defined]  (the FSDP wrap policy needs the class)
    return model


def flops_per_token(model: Any, cfg: dict[str, int]) -> float:
    """6 N (N without position embeddings) + attention 12 L d T: the usual training-FLOPs estimate."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * cfg["layers"] * cfg["d"] * cfg["seq"]


def peak_flops(device_name: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override * 1e12, f"{override:g} TFLOP/s (--peak-tflops)"
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return (
                tflops * 1e12,
                f"{tflops:g} TFLOP/s dense bf16 ({fragment}, from the table in gpu_bench.py)",
            )
    return None, "unknown device: pass --peak-tflops for MFU"


# ------------------------------------------------------------------------------------------------ training
class Trainer:
    """One variant: model, optimizer and the step function, raw or through a Fabric."""

    def __init__(
        self, impl: str, mode: str, args: argparse.Namespace, cfg: dict[str, int], device: Any
    ) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.fabric = None
        model = build_model(cfg)
        fused = device.type == "cuda" and mode != "fsdp"  # fused AdamW over DTensor shards: not relied on
        if impl == "raw":
            self.rank, self.world = 0, 1
            if mode in ("ddp", "fsdp"):
                import torch.distributed as dist

                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
                self.rank, self.world = dist.get_rank(), dist.get_world_size()
            model.to(device)
            if mode == "ddp":
                ids = [device.index] if device.type == "cuda" else None
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            elif mode == "fsdp":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mesh = init_device_mesh(device.type, (self.world,))
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.blocks:
                    fully_shard(block, mesh=mesh, mp_policy=policy)
                root = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
                )
                fully_shard(model, mesh=mesh, mp_policy=root)
            self.autocast = mode != "fsdp"  # FSDP2 casts through its policy, not autocast
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
        else:
            from fabric_core import Fabric

            strategy: Any = "auto"
            if mode == "ddp":
                strategy = "ddp"
            elif mode == "fsdp":
                from fabric_fsdp.strategy import FSDPStrategy

                strategy = FSDPStrategy(auto_wrap_policy={model.block_class})
            devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if mode != "single" else 1
            accelerator = "cuda" if device.type == "cuda" else "cpu"
            self.fabric = Fabric(
                accelerator=accelerator, strategy=strategy, devices=devices, precision="bf16-mixed"
            )
            if mode != "single":
                self.fabric.launch()
            self.rank, self.world = self.fabric.global_rank, self.fabric.world_size
            if mode == "fsdp":  # optimizer after sharding, as FSDP wants
                self.model = self.fabric.setup_module(model)
                self.opt = self.fabric.setup_optimizers(
                    torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=fused)
                )
            else:
                self.model, self.opt = self.fabric.setup(
                    model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
                )
        g = torch.Generator().manual_seed(1 + self.rank)
        shape = (args.batch, cfg["seq"])
        self.x = torch.randint(0, cfg["vocab"], shape, generator=g).to(device)
        self.y = torch.randint(0, cfg["vocab"], shape, generator=g).to(device)

    def steps(self, n: int) -> float:
        """Run ``n`` steps; return the seconds they took (device synchronised at both ends)."""
        torch = self.torch
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            if self.fabric is None:
                if self.autocast:
                    with torch.autocast(self.device.type, dtype=torch.bfloat16):
                        loss = self.model(self.x, self.y)
                else:
                    loss = self.model(self.x, self.y)
                loss.backward()
            else:
                loss = self.model(self.x, self.y)
                self.fabric.backward(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0


def model_config(args: argparse.Namespace) -> dict[str, int]:
    if args.cpu_dry_run:
        return {"vocab": 512, "ctx": 64, "layers": 2, "heads": 2, "d": 64, "seq": 64}
    return {"vocab": 50304, "ctx": 1024, "layers": 12, "heads": 12, "d": 768, "seq": args.seq}


def local_device(args: argparse.Namespace) -> Any:
    import torch

    if args.cpu_dry_run:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ------------------------------------------------------------------------------------------------ workers
def worker(args: argparse.Namespace) -> None:
    """Inside a torchrun job: one variant, one mode; rank 0 prints tokens/s."""
    cfg = model_config(args)
    trainer = Trainer(args.impl, args.worker, args, cfg, local_device(args))
    trainer.steps(args.warmup)
    seconds = trainer.steps(args.steps)
    if trainer.rank == 0:
        tokens = args.batch * cfg["seq"] * args.steps * trainer.world
        emit({"tokens_per_s": tokens / seconds, "world_size": trainer.world})
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_job(mode: str, impl: str, args: argparse.Namespace, nproc: int) -> dict[str, Any]:
    cmd = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(__file__),
    ]
    cmd += [
        "--worker",
        mode,
        "--impl",
        impl,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
    ]
    cmd += ["--seq", str(args.seq)] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
    env = child_env({"OMP_NUM_THREADS": "1"} if args.cpu_dry_run else None)
    return run_child(cmd, timeout=args.job_timeout, env=env)


# ------------------------------------------------------------------------------------------------ sections
def _summarise(
    raw: list[float], ours: list[float], fpt: float, peak: float | None, world: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens_per_s": {"raw": summarize(raw), "ours": summarize(ours)}}
    out["ratio"] = paired_ratios(ours, raw)
    if peak:
        out["mfu"] = {
            k: statistics.median(v) * fpt / (peak * world) for k, v in (("raw", raw), ("ours", ours))
        }
    return out


def section_single(
    args: argparse.Namespace, cfg: dict[str, int], fpt: float, peak: float | None
) -> dict[str, Any]:
    if not module_available("fabric_amp"):
        return {
            "status": "skipped",
            "reason": "`fabric_amp` is not importable: install fabric-amp (plugins/amp) for bf16-mixed",
        }
    device = local_device(args)
    trainers = {impl: Trainer(impl, "single", args, cfg, device) for impl in ("raw", "ours")}
    for t in trainers.values():
        t.steps(args.warmup)
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    for rep in range(args.reps):
        for impl in rotated(["raw", "ours"], rep):
            times[impl].append(trainers[impl].steps(args.steps))
    tokens = args.batch * cfg["seq"] * args.steps
    res = _summarise([tokens / s for s in times["raw"]], [tokens / s for s in times["ours"]], fpt, peak, 1)
    del trainers
    return {"status": "ok", "world_size": 1, **res}


def section_parallel(
    mode: str, args: argparse.Namespace, nproc: int, fpt: float, peak: float | None
) -> dict[str, Any]:
    plugin = {"ddp": "fabric_ddp", "fsdp": "fabric_fsdp"}[mode]
    for needed in ("fabric_amp", plugin):
        if not module_available(needed):
            dist = needed.replace("_", "-")
            return {"status": "skipped", "reason": f"`{needed}` is not importable: install {dist}"}
    results: dict[str, list[float]] = {"raw": [], "ours": []}
    for rep in range(args.reps):
        for impl in rotated(["raw", "ours"], rep):
            results[impl].append(run_job(mode, impl, args, nproc)["tokens_per_s"])
    return {
        "status": "ok",
        "world_size": nproc,
        **_summarise(results["raw"], results["ours"], fpt, peak, nproc),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition per section")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="measured steps per repetition")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="sequences per device and step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--sections", default="single,ddp,fsdp")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/gpu_latest.json)")
    p.add_argument("--job-timeout", type=int, default=600)
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=("raw", "ours"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device is available, so there is nothing to measure here (this benchmark needs an NVIDIA GPU)."
        )
        return 0
    if args.quick:
        args.reps = 1
    if args.cpu_dry_run:
        args.warmup, args.batch, args.seq = 1, 2, 64
        nproc, name = 2, "cpu (dry run: numbers mean nothing)"
    else:
        nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    cfg = model_config(args)
    fpt = flops_per_token(build_model(cfg), cfg)
    peak, peak_note = peak_flops(name, args.peak_tflops)
    results: dict[str, Any] = {
        "device": name,
        "devices": nproc,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": {**cfg, "batch_per_device": args.batch, "flops_per_token": fpt},
        "peak": peak_note,
        "steps": args.steps,
        "reps": args.reps,
        "sections": {},
    }
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    results["model"]["parameters"] = n_params
    print(
        f"gpu_bench on {nproc} x {name}: GPT ({n_params / 1e6:.0f}M parameters, {fpt / 1e9:.2f} GFLOP/token),"
        f" bf16-mixed, batch {args.batch} x {cfg['seq']} per device",
        flush=True,
    )
    for section in [s.strip() for s in args.sections.split(",") if s.strip()]:
        t0 = time.time()
        try:
            if section == "single":
                res = section_single(args, cfg, fpt, peak)
            elif section in ("ddp", "fsdp"):
                res = section_parallel(section, args, nproc, fpt, peak)
            else:
                res = {"status": "skipped", "reason": f"unknown section {section!r}"}
        except Exception as err:  # report and go on with the next section
            res = {"status": "error", "reason": f"{type(err).__name__}: {err}"[-3000:]}
        res["elapsed_s"] = round(time.time() - t0, 1)
        results["sections"][section] = res
        if res["status"] == "ok":
            tps = res["tokens_per_s"]
            mfu = res.get("mfu")
            mfu_text = f", MFU raw {mfu['raw']:.1%} ours {mfu['ours']:.1%}" if mfu else ""
            print(
                f"[{section}] tokens/s raw {tps['raw']['median']:,.0f} ours {tps['ours']['median']:,.0f}"
                f" ratio {res['ratio']['median']:.3f} [{res['ratio']['min']:.3f}-{res['ratio']['max']:.3f}]{mfu_text}",
                flush=True,
            )
        else:
            print(f"[{section}] {res['status']}: {res['reason']}", flush=True)
    out = (
        args.out
        if args.out is not None
        else (None if args.cpu_dry_run else os.path.join(HERE, "results", "gpu_latest.json"))
    )
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
