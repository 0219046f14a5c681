"""Training through DeepSpeed engines on real ranks: stages x precisions, offload, accumulation, the seeds' rules.

``python train_checks.py OUT`` on every rank (started externally, as torchrun would). One process pair builds
several Fabric objects in turn (they share the process group) and writes ``train.json`` for the test.
"""

from __future__ import annotations

import warnings

import ds_common as c
import torch
from torch import nn

from fabric_core import Fabric
from fabric_deepspeed import DeepSpeedStrategy

STEPS = 6
ACCUMULATE_AT = 2


def train(fabric: Fabric, steps: int = STEPS, accumulate_at: int | None = None) -> dict:
    model = c.make_model()
    model, optimizer = fabric.setup(model, c.make_optimizer(model))
    x, y = c.make_data(steps, fabric.world_size)
    rank = fabric.global_rank
    losses = []
    for s in range(steps):
        optimizer.zero_grad()
        xs, ys = c.local(x[s], rank), c.local(y[s], rank)
        if s == accumulate_at:  # two micro-batches, then one step
            for h in (slice(0, c.BATCH // 2), slice(c.BATCH // 2, c.BATCH)):
                fabric.backward(c.loss_fn(model(xs[h]), ys[h]) / 2)
            with torch.no_grad():
                loss = c.loss_fn(model(xs), ys)
        else:
            loss = c.loss_fn(model(xs), ys)
            fabric.backward(loss)
        optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    inner = model.module
    return {
        "losses": losses,
        "param_dtype": str(next(inner.parameters()).dtype),
        "output_dtype": str(model(c.local(x[0], rank)).dtype),
        "optimizer": type(optimizer).__mro__[1].__name__,
        "engine_steps": fabric.strategy.engines[-1].global_steps,
        "managed_accumulation": fabric.strategy.config["managed_gradient_accumulation"],
    }


def main() -> None:
    out = c.out_dir()
    result: dict = {"runs": {}}
    cases = [
        ("stage1_fp32", {"stage": 1}, "32-true", None),
        ("stage2_fp32", {"stage": 2}, "32-true", ACCUMULATE_AT),
        ("stage3_fp32", {"stage": 3}, "32-true", None),
        ("stage2_bf16", {"stage": 2}, "bf16-mixed", None),
        ("stage3_bf16", {"stage": 3}, "bf16-mixed", None),
        ("stage3_bf16_true", {"stage": 3}, "bf16-true", None),
        ("stage2_offload", {"stage": 2, "offload_optimizer": True}, "32-true", None),
        ("stage3_offload", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}, "32-true", None),
    ]
    for name, options, precision, accumulate_at in cases:
        c.mark(name)
        fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(**options), devices=2, precision=precision)
        fabric.launch()
        result["runs"][name] = train(fabric, accumulate_at=accumulate_at)
        result["runs"][name]["precision"] = type(fabric.strategy.precision).__name__
    result["world_size"] = fabric.world_size

    # The seeds' rules, on a stage-2 Fabric.
    c.mark("rules")
    fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=2)
    fabric.launch()
    errors: dict[str, str] = {}
    loss = torch.ones(1, requires_grad=True).sum()
    errors["backward_without_model"] = c.expect_error(RuntimeError, "No models were set up for backward", fabric.backward, loss)
    a, b = c.make_model(1), c.make_model(2)
    a, opt_a = fabric.setup(a, c.make_optimizer(a))
    b, opt_b = fabric.setup(b, c.make_optimizer(b))
    x = torch.randn(c.BATCH, c.D_IN)
    errors["ambiguous_backward"] = c.expect_error(
        ValueError, "When using multiple models + deepspeed", fabric.backward, b(x).sum()
    )
    before_a = {k: v.clone() for k, v in a.module.state_dict().items()}
    before_b = {k: v.clone() for k, v in b.module.state_dict().items()}
    fabric.backward(b(x).pow(2).mean(), model=b)
    opt_b.step()  # steps b's engine, not the one set up last or used last
    result["step_moves_only_its_model"] = {
        "a_changed": any(not torch.equal(before_a[k], v) for k, v in a.module.state_dict().items()),
        "b_changed": any(not torch.equal(before_b[k], v) for k, v in b.module.state_dict().items()),
    }
    fabric.backward(a(x).pow(2).mean(), model=a)
    opt_a.step()
    result["a_changed_after_its_step"] = any(not torch.equal(before_a[k], v) for k, v in a.module.state_dict().items())
    errors["plain_backward"] = c.expect_error(RuntimeError, "fabric.backward(loss)", lambda: a(x).sum().backward())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fabric.no_backward_sync(a):
            pass
    result["no_backward_sync_warnings"] = [str(w.message) for w in caught if "synchronization" in str(w.message)]
    errors["clip_norm"] = c.expect_error(
        NotImplementedError, "DeepSpeed handles gradient clipping", fabric.clip_gradients, a, opt_a, max_norm=1.0
    )
    errors["clip_value"] = c.expect_error(
        NotImplementedError, "gradient_clipping", fabric.clip_gradients, a, opt_a, clip_val=1.0
    )
    other = c.make_model()
    errors["setup_optimizers"] = c.expect_error(
        RuntimeError, "requires the model and optimizer(s) to be set up jointly", fabric.setup_optimizers, c.make_optimizer(other)
    )
    two = c.make_model()
    errors["two_optimizers"] = c.expect_error(
        ValueError,
        "Currently only one optimizer is supported with DeepSpeed",
        fabric.setup,
        two,
        torch.optim.SGD(two.inp.parameters(), lr=0.1),
        torch.optim.SGD(two.out.parameters(), lr=0.1),
    )
    errors["closure"] = c.expect_error(TypeError, "closure", opt_a.step, lambda: 0.0)

    # A model set up alone: evaluation through an engine, for stage 2 (no ZeRO needed) and stage 3 (partitioned).
    for stage in (2, 3):
        fabric = Fabric(accelerator="cpu", strategy=f"deepspeed_stage_{stage}", devices=2)
        fabric.launch()
        plain = c.make_model(5)
        expected = plain(x)
        evaluated = fabric.setup_module(c.make_model(5))
        with torch.no_grad():
            result[f"setup_module_stage{stage}_diff"] = float((evaluated(x) - expected).abs().max())

    # init_module under stage 3 partitions every parameter as it is built (deepspeed.zero.Init).
    fabric = Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(stage=3, config=None), devices=2)
    fabric.launch()
    with fabric.init_module():
        big = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    result["zero_init"] = {
        "local_numel": sum(p.numel() for p in big.parameters()),
        "partition_numel": sum(p.ds_tensor.numel() for p in big.parameters()),
        "full_numel": sum(p.ds_numel for p in big.parameters()),
    }
    errors["empty_init_false"] = c.expect_error(NotImplementedError, "empty_init=False", fabric.init_module, empty_init=False)
    big, big_opt = fabric.setup(big, torch.optim.SGD(big.parameters(), lr=0.1))
    fabric.backward(big(torch.randn(2, 512)).pow(2).mean())
    big_opt.step()

    # NVMe offload refuses a path it cannot write to before DeepSpeed starts (no JIT build for that).
    nvme = Fabric(accelerator="cpu", strategy="deepspeed_stage_3_offload_nvme", devices=2)
    errors["nvme_path"] = c.expect_error(ValueError, "nvme_path='/local_nvme'", nvme.launch)

    result["errors"] = errors
    if fabric.global_rank == 0:
        c.dump(out / "train.json", result)
    fabric.barrier()


if __name__ == "__main__":
    main()
