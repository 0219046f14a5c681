"""Train a small byte-level Transformer language model with two DDP processes on the CPU.

This is the script behind ``make demo``. It exercises the parts of Fabric a real training script needs:
launching processes, building the model through ``fabric.init_module``, ``fabric.setup`` and
``fabric.setup_dataloaders``, gradient accumulation without redundant gradient syncs
(``fabric.no_backward_sync``), gradient clipping, metrics logged to CSV and TensorBoard, a loss averaged across
processes with ``fabric.all_reduce``, and a checkpoint that is saved and loaded back.

The corpus is the source code of a fixed list of pure-Python standard-library modules, read from the
directory of the running interpreter (``os.path.dirname(os.__file__)``). It ships with every Python, so the
demo downloads nothing, and code is a good toy corpus: regular enough that a tiny model learns visible
structure (indentation, keywords, ``self.``) within a few hundred steps. The model reads raw bytes (a
vocabulary of 256), so no tokenizer is needed either. The exact bytes differ slightly between Python versions.

Run it::

    python examples/demo/train_lm.py                                 # 2 processes, strategy="ddp", CPU
    python examples/demo/train_lm.py --devices 1 --strategy auto     # one process, no DDP
    fabric run --devices 2 examples/demo/train_lm.py                 # the CLI starts the processes

Under ``fabric run`` the CLI has already started the processes and decides accelerator, strategy, devices and
precision, so the script must neither call ``fabric.launch()`` nor pass its own defaults for those settings
(Fabric rejects a value that conflicts with the CLI). ``fabric run`` marks the processes it starts with the
environment variable ``FABRIC_CLI_USED=1``; the script checks it once, in :func:`cli`. The training code lives
in :func:`main`, which takes the ``Fabric`` object: ``fabric.launch(main, args)`` runs it in every process
(this form also works with spawn-based strategies such as ``ddp_spawn``), and under the CLI it is simply called.

The last line printed has the form ``final loss X.XXXX | tokens/s N | world_size W | checkpoint PATH``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from fabric_core import Fabric
from fabric_core.loggers import CSVLogger, TensorBoardLogger
from fabric_core.runtime.progress import ProgressBar

# Pure-Python standard-library modules that exist as single files on every supported Python (3.10+).
CORPUS_MODULES = (
    "argparse",
    "dataclasses",
    "functools",
    "textwrap",
    "contextlib",
    "heapq",
    "bisect",
    "string",
    "shlex",
    "csv",
    "copy",
    "random",
    "pprint",
    "calendar",
    "fractions",
    "json/decoder",
    "json/encoder",
    "collections/__init__",
)
VOCAB_SIZE = 256  # bytes
# The settings the plain `python train_lm.py` run uses; under `fabric run` the CLI decides them instead.
SCRIPT_DEFAULTS = {"accelerator": "cpu", "strategy": "ddp", "devices": 2, "precision": "32-true"}


# --------------------------------------------------------------------------------------------------- data
def read_corpus() -> tuple[bytes, list[str]]:
    """Concatenate the source of :data:`CORPUS_MODULES`; modules missing from this Python are skipped."""
    stdlib = Path(os.path.dirname(os.__file__))
    parts, used = [], []
    for name in CORPUS_MODULES:
        path = stdlib / f"{name}.py"
        if path.is_file():
            parts.append(path.read_bytes())
            used.append(name.replace("/__init__", "").replace("/", "."))
    corpus = b"\n\n".join(parts)
    if len(corpus) < 100_000:
        raise RuntimeError(
            f"Found only {len(corpus)} bytes of standard-library source in {stdlib}; this Python seems to ship"
            " without .py sources, which the demo uses as its corpus."
        )
    return corpus, used


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: input is the first ``seq_len``, target is shifted by one."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


# --------------------------------------------------------------------------------------------------- model
class ByteTransformerLM(nn.Module):
    """A decoder-only language model built from ``nn.TransformerEncoder`` layers and a causal mask."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, max_len: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)

    def forward(self, tokens: Tensor) -> Tensor:
        """Return next-byte logits of shape ``(batch, seq, 256)``."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        hidden = self.embed(tokens) + self.pos(positions)
        # Built per call in the activations' dtype, so the model works under every precision setting.
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device, dtype=hidden.dtype)
        hidden = self.encoder(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))

    @torch.no_grad()
    def generate(self, prompt: bytes, n_new: int, temperature: float = 0.8, seed: int = 0) -> bytes:
        """Sample ``n_new`` bytes after ``prompt`` (plain module, no collectives: safe to run on one rank)."""
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        tokens = torch.tensor(list(prompt), device=device).unsqueeze(0)
        for _ in range(n_new):
            logits = self(tokens[:, -self.max_len :])[0, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        self.train(was_training)
        return bytes(tokens[0, len(prompt) :].tolist())


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# --------------------------------------------------------------------------------------------------- training
def main(fabric: Fabric, args: argparse.Namespace) -> dict[str, Any]:
    """The training run; executed in every process."""
    fabric.seed_everything(args.seed)

    corpus, modules = read_corpus()
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    split = int(len(data) * 0.95)
    train_set = ByteWindows(data[:split], args.seq_len)
    val_set = ByteWindows(data[split:], args.seq_len)
    fabric.print(
        f"corpus: {len(modules)} stdlib modules from {os.path.dirname(os.__file__)}, {len(corpus):,} bytes"
        f" ({len(train_set):,} train / {len(val_set):,} validation windows of {args.seq_len} bytes)"
    )

    # Built directly on the device and in the precision's dtype.
    with fabric.init_module():
        model = ByteTransformerLM(args.d_model, args.layers, args.heads, args.seq_len, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    # Each process now sees its own shard (DistributedSampler) and batches arrive on the right device.
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)

    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len * args.accumulate * fabric.world_size
    fabric.print(
        f"model: {n_params:,} parameters | {fabric!r} | {args.max_steps} steps of {tokens_per_step:,} tokens"
        f" (world size {fabric.world_size} x {args.accumulate} micro-batches x {args.batch_size} sequences"
        f" x {args.seq_len} bytes)"
    )

    model.train()
    step, loss_value, batches = 0, float("nan"), iter(train_loader)
    # Shown by rank 0 only: a bar in a terminal, a line every 30 s in a log file.
    bar = ProgressBar(total=args.max_steps, desc="train", unit="step", items_unit="tokens")
    start = time.perf_counter()
    while step < args.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, args.warmup, args.max_steps)
        step_loss = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            try:
                inputs, targets = next(batches)
            except StopIteration:  # next epoch: the wrapped loader reshuffles (sampler.set_epoch)
                batches = iter(train_loader)
                inputs, targets = next(batches)
            is_accumulating = micro < args.accumulate - 1
            # Forward and backward of all but the last micro-batch skip DDP's gradient all-reduce.
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / args.accumulate
                fabric.backward(loss)
            step_loss += loss.detach()
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        loss_value = fabric.all_reduce(step_loss, reduce_op="mean").item()  # the same number on every rank
        if step % args.log_every == 0 or step == args.max_steps:
            fabric.log_dict(
                {
                    "train/loss": loss_value,
                    "train/grad_norm": grad_norm,
                    "train/lr": optimizer.param_groups[0]["lr"],
                },
                step=step,
            )
        bar.update(loss=loss_value, items=tokens_per_step)
    elapsed = time.perf_counter() - start
    bar.close()

    # Throughput is set by the slowest process: take the longest training time of all ranks.
    elapsed = fabric.all_reduce(torch.tensor(elapsed, device=fabric.device), reduce_op="max").item()
    tokens_per_sec = step * tokens_per_step / elapsed

    val_loss = evaluate(fabric, model, val_loader)
    fabric.log_dict({"val/loss": val_loss, "train/tokens_per_sec": tokens_per_sec}, step=step)
    fabric.print(
        f"validation loss {val_loss:.4f} ({val_loss / math.log(2):.3f} bits/byte) after {step} steps"
    )

    ckpt_path = os.path.abspath(os.path.join(args.out_dir, "checkpoints", "lm-final.ckpt"))
    hparams = {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "seq_len": args.seq_len}
    fabric.save(ckpt_path, {"model": model, "optimizer": optimizer, "step": step, "hparams": hparams})
    restored = check_checkpoint(fabric, ckpt_path, model, optimizer, step, hparams, args)

    if fabric.is_global_zero and args.sample_bytes > 0:
        text = restored.generate(b"    def ", args.sample_bytes, seed=args.seed)
        fabric.print(
            "sample from the reloaded checkpoint:\n    def " + text.decode("utf-8", errors="replace")
        )
    for logger in fabric.loggers:
        logger.finalize("success")
    fabric.print(f"logs: {fabric.loggers[0].log_dir} (CSV) | {fabric.loggers[1].log_dir} (TensorBoard)")
    fabric.print(
        f"final loss {loss_value:.4f} | tokens/s {tokens_per_sec:.0f} | world_size {fabric.world_size}"
        f" | checkpoint {ckpt_path}"
    )
    return {
        "loss": loss_value,
        "val_loss": val_loss,
        "tokens_per_sec": tokens_per_sec,
        "checkpoint": ckpt_path,
    }


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> float:
    """Mean validation loss over all processes' shards: sums and counts are all-reduced, then divided."""
    model.eval()
    totals = torch.zeros(2, device=fabric.device, dtype=torch.float64)
    for inputs, targets in loader:
        logits = model(inputs)
        totals[0] += F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
        ).double()
        totals[1] += targets.numel()
    model.train()
    totals = fabric.all_reduce(totals, reduce_op="sum")
    return (totals[0] / totals[1]).item()


def check_checkpoint(
    fabric: Fabric,
    path: str,
    model: nn.Module,
    optimizer: Any,
    step: int,
    hparams: dict,
    args: argparse.Namespace,
) -> ByteTransformerLM:
    """Load the checkpoint into a fresh, plain model and optimizer and verify that everything came back."""
    fresh = ByteTransformerLM(hparams["d_model"], hparams["layers"], hparams["heads"], hparams["seq_len"])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=args.lr, weight_decay=0.01)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = fabric.load(path, state)  # restores in place; returns what `state` did not ask for

    trained = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    loaded = {k: v.float() for k, v in fresh.state_dict().items()}
    problems = []
    if state["step"] != step:
        problems.append(f"step {state['step']} != {step}")
    if remainder.get("hparams") != hparams:
        problems.append(f"hparams {remainder.get('hparams')} != {hparams}")
    if trained.keys() != loaded.keys() or any(not torch.equal(trained[k], loaded[k]) for k in trained):
        problems.append("model weights differ")
    saved_opt, loaded_opt = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    if saved_opt.keys() != loaded_opt.keys() or any(
        not torch.equal(saved_opt[i]["exp_avg"].float().cpu(), loaded_opt[i]["exp_avg"].float())
        for i in saved_opt
    ):
        problems.append("optimizer state differs")
    if problems:
        raise RuntimeError(f"Checkpoint round trip failed for {path}: {'; '.join(problems)}")
    fabric.print(f"checkpoint round trip OK: {len(loaded)} tensors, optimizer state and step={step} restored")
    return fresh


# --------------------------------------------------------------------------------------------------- entry point
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    group = parser.add_argument_group(
        "Fabric (defaults apply to `python train_lm.py`; under `fabric run` the CLI decides)"
    )
    group.add_argument("--accelerator", default=None, help=f"default: {SCRIPT_DEFAULTS['accelerator']}")
    group.add_argument("--strategy", default=None, help=f"default: {SCRIPT_DEFAULTS['strategy']}")
    group.add_argument("--devices", default=None, help=f"default: {SCRIPT_DEFAULTS['devices']}")
    group.add_argument("--precision", default=None, help=f"default: {SCRIPT_DEFAULTS['precision']}")
    parser.add_argument("--max-steps", type=int, default=250, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per process")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0, help="no need for it in a run this short")
    parser.add_argument("--lr", type=float, default=6e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--log-every", type=int, default=5, help="log metrics every N steps")
    parser.add_argument(
        "--sample-bytes", type=int, default=160, help="bytes to sample from the trained model (0: none)"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out-dir", default="demo_output", help="checkpoint and logs go here")
    return parser.parse_args(argv)


def launched_by_cli() -> bool:
    """``fabric run`` sets ``FABRIC_CLI_USED=1`` in every process it starts."""
    return os.environ.get("FABRIC_CLI_USED") == "1"


def cli(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    under_cli = launched_by_cli()
    settings = {}
    for key, default in SCRIPT_DEFAULTS.items():
        value = getattr(args, key)
        if value is None and not under_cli:
            value = default
        if value is not None:  # under the CLI, only what was asked for explicitly (the CLI decides the rest)
            settings[key] = int(value) if key == "devices" and str(value).isdigit() else value
    loggers = [CSVLogger(args.out_dir, name="csv"), TensorBoardLogger(args.out_dir, name="tensorboard")]
    fabric = Fabric(**settings, loggers=loggers)
    if under_cli:  # the processes exist already; calling launch() would raise
        return main(fabric, args)
    return fabric.launch(main, args)


if __name__ == "__main__":
    cli()
