"""The loop helpers (issue 31): ``fabric.accumulate`` and ``EMA``; multi-rank behaviour on real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import run_ranks
from torch import nn

from fabric_core import Fabric
from fabric_core.loop.ema import EMA

SCRIPT = Path(__file__).parent / "scripts" / "loop_job.py"


def _setup(fabric: Fabric, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))


def test_accumulate_yields_true_on_the_last_micro_batch_of_each_window():
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    flags = []
    for _ in range(7):
        with fabric.accumulate(model, 3) as last:
            flags.append(last)
    assert flags == [False, False, True, False, False, True, False]
    other, _ = _setup(fabric)  # each model counts its own window
    with fabric.accumulate(other, 1) as last:
        assert last


def test_accumulated_gradients_equal_one_large_batch_on_one_device():
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    for chunk_x, chunk_y in zip(x.chunk(4), y.chunk(4)):
        with fabric.accumulate(model, 4):
            fabric.backward(nn.functional.mse_loss(model(chunk_x), chunk_y) / 4)
    nn.functional.mse_loss(reference(x), y).backward()
    assert torch.allclose(model.weight.grad, reference.weight.grad, atol=1e-6)


@pytest.mark.parametrize("steps", [0, -1])
def test_accumulate_refuses_a_bad_number_of_steps(steps):
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    with pytest.raises(ValueError, match="positive number of micro-batches"), fabric.accumulate(model, steps):
        pass


@pytest.mark.parametrize("steps", [2.5, 2.0, True, "2", None])
def test_accumulate_refuses_a_count_that_is_not_an_int_with_a_type_error(steps):
    """docs/decisions.md: a bad argument type is a TypeError (2.5 used to be a ValueError), naming what was given."""
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    with pytest.raises(TypeError, match=rf"whole number of micro-batches \(an int\), got {type(steps).__name__} "):
        with fabric.accumulate(model, steps):
            pass


def test_accumulate_needs_a_set_up_model():
    with pytest.raises(TypeError, match=r"needs the model returned by `fabric.setup\(...\)`"), Fabric(accelerator="cpu").accumulate(nn.Linear(2, 2), 2):
        pass


def test_ema_averages_and_evaluates_with_the_averages():
    fabric = Fabric(accelerator="cpu")
    model, optimizer = _setup(fabric)
    ema = EMA(model, decay=0.75)
    expected = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    for _ in range(3):
        fabric.backward(model(torch.ones(4, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        expected = {n: 0.75 * v + 0.25 * dict(model.module.named_parameters())[n].detach() for n, v in expected.items()}
    assert all(torch.allclose(ema.averages[n], v) for n, v in expected.items())
    trained = model.weight.detach().clone()
    with ema.average_parameters():
        assert torch.equal(model.weight, ema.averages["weight"])
        averaged_output = model(torch.ones(1, 3))
    assert torch.equal(model.weight, trained)
    assert not torch.equal(averaged_output, model(torch.ones(1, 3)))


def test_ema_warmup_follows_the_weights_early():
    """With warm-up the n-th update keeps min(decay, (1 + n) / (10 + n)) of the average: after a few training steps
    the average sits near the trained weights (decay 0.999 alone would leave it at the initial ones). Checked against
    the same averages computed here in plain torch, update by update."""
    fabric = Fabric(accelerator="cpu")
    model, optimizer = _setup(fabric)
    ema = EMA(model, decay=0.999, warmup=True)
    initial = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    expected = {n: v.clone() for n, v in initial.items()}
    for n in range(5):
        fabric.backward(model(torch.ones(4, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
        decay = min(0.999, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(decay)
        ema.update()
        expected = {k: decay * v + (1 - decay) * dict(model.module.named_parameters())[k].detach() for k, v in expected.items()}
        for k, v in expected.items():
            torch.testing.assert_close(ema.averages[k], v, rtol=0, atol=1e-6)
    assert ema.num_updates == 5
    trained = dict(model.module.named_parameters())
    for k in expected:
        moved = (trained[k].detach() - initial[k]).abs().max()
        assert moved > 0.1, "the weights must move for the check to mean something"
        # warm-up: the average went most of the way (more than half) from the initial weights to the trained ones
        assert (ema.averages[k] - trained[k].detach()).abs().max() < 0.5 * moved, k
    ema.num_updates = 10_000
    assert ema.current_decay() == 0.999


def test_ema_round_trips_exactly_through_fabric_save_and_load(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model, optimizer = _setup(fabric)
    ema = EMA(model, decay=0.9)
    for _ in range(2):
        fabric.backward(model(torch.randn(4, 3)).sum())
        optimizer.step()
        ema.update()
    fabric.save(tmp_path / "ckpt", {"model": model, "ema": ema})
    other, _ = _setup(fabric, seed=1)
    restored = EMA(other, decay=0.5)
    fabric.load(tmp_path / "ckpt", {"model": other, "ema": restored})
    assert all(torch.equal(restored.averages[n], v) for n, v in ema.averages.items())
    assert (restored.decay, restored.num_updates) == (0.9, 2)


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9", True])
def test_ema_refuses_a_bad_decay(decay):
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\)"):
        EMA(nn.Linear(2, 2), decay=decay)


def test_ema_state_of_another_model_is_refused():
    ema = EMA(nn.Linear(2, 2))
    state = EMA(nn.Sequential(nn.Linear(2, 2))).state_dict()
    with pytest.raises(KeyError, match="does not match the model"):
        ema.load_state_dict(state)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2"])
def test_accumulate_ema_and_profile_on_two_processes(tmp_path, strategy):
    plugin = {"ddp": "fabric_ddp", "fsdp": "fabric_fsdp", "deepspeed_stage_2": "fabric_deepspeed"}[strategy]
    pytest.importorskip(plugin, reason=f"{plugin} is not installed (the XLA lane installs only fabric-xla)")
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="fabric-deepspeed's dependency (`make setup` installs it)")
    run_ranks(SCRIPT, str(tmp_path), strategy, timeout=300, tmp_path=tmp_path)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["synced"] == [False, False, False, True]
        assert seen.get("grads_match", True), "accumulated gradients differ from one step on all micro-batches"
        assert seen["step_matches"], "the step after accumulating differs from one step on all micro-batches"
        if strategy == "ddp":
            assert seen["unsynced_differs"] == [True, True, True], "gradients were synchronised inside the window"
        assert seen["ema_matches"] and seen["evaluates_with_averages"] and seen["restored_exactly"]
        assert seen["ema_round_trip"] and seen["ema_counters"] == [3, 0.5] and seen["ema_layout_kept"]
        assert [p.name for p in (tmp_path / "profile" / f"rank{rank}").iterdir()] == [f"rank{rank}.pt.trace.json"]
    assert "Self CPU" in (tmp_path / "profile" / "summary-rank0.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0", "rank1", "summary-rank0.txt"]


def test_profile_writes_a_trace_and_prints_a_summary_on_rank_zero(tmp_path, capsys):
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    with fabric.profile(tmp_path / "prof", row_limit=100, record_shapes=True) as prof:
        fabric.backward(model(torch.randn(8, 3)).sum())
    trace = tmp_path / "prof" / "rank0" / "rank0.pt.trace.json"
    assert json.loads(trace.read_text())["traceEvents"]
    summary = (tmp_path / "prof" / "summary-rank0.txt").read_text()
    assert "aten::addmm" in summary and summary in capsys.readouterr().out
    assert any(e.key == "aten::addmm" for e in prof.key_averages())


def test_profile_with_a_schedule_records_the_active_steps(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model, _ = _setup(fabric)
    with fabric.profile(tmp_path, schedule={"warmup": 1, "active": 2, "repeat": 1}) as prof:
        for _ in range(5):
            model(torch.randn(4, 3))
            prof.step()
    traces = list((tmp_path / "rank0").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1  # one cycle: one trace
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::addmm") == 2  # the 2 active steps only


def test_profile_refuses_a_bad_schedule(tmp_path):
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(TypeError, match="Its keys are those of `torch.profiler.schedule`"), fabric.profile(tmp_path, schedule={"activ": 2}):
        pass
    with pytest.raises(TypeError, match=r"takes a `torch.profiler.schedule\(...\)` or a dict"), fabric.profile(tmp_path, schedule=3):
        pass


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def test_compile_blocks_finds_the_repeated_layers_and_keeps_names():
    from fabric_core.loop.compile import compile_blocks, is_compiled_block, repeated_blocks

    model = Stack()
    assert [n for n, _ in repeated_blocks(model)] == ["layers.0", "layers.1", "layers.2"]
    keys = list(model.state_dict())
    assert compile_blocks(model, backend="aot_eager") == ["layers.0", "layers.1", "layers.2"]
    assert list(model.state_dict()) == keys  # compiled in place: a checkpoint's keys do not change
    assert all(is_compiled_block(layer) for layer in model.layers) and not is_compiled_block(model)
    assert compile_blocks(Stack(), blocks=Block, backend="aot_eager") == ["layers.0", "layers.1", "layers.2"]
    assert compile_blocks(Stack(), blocks=lambda m: m.__class__ is nn.Linear, backend="aot_eager")[:2] == ["inp", "layers.0.linear"]


def test_compile_blocks_says_what_to_do_when_nothing_matches():
    from fabric_core.loop.compile import compile_blocks

    with pytest.raises(ValueError, match="it has no repeated blocks.*compile_blocks\\(model, blocks=TransformerBlock\\)"):
        compile_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no submodule matches `blocks`"):
        compile_blocks(Stack(), blocks=nn.Conv2d)
    with pytest.raises(TypeError, match="takes a module class"):
        compile_blocks(Stack(), blocks="Block")


@pytest.mark.parametrize("block_class", ["ours", "torch"])
def test_a_model_compiled_per_block_trains_as_the_eager_one(block_class):
    """Set up by Fabric after ``compile_blocks``: the same losses and weights as the eager model, step by step, and
    the blocks really run compiled (one graph for all of them), also torch's own classes, which ``Module.compile``
    would leave eager. (A recording backend in front of ``aot_eager``, which traces forward and backward as inductor
    does without its C++ build: inductor on the CPU is measured in benchmarks/compile_blocks.py.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from fabric_core.loop.compile import compile_blocks

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g))(gm, example_inputs)

    fabric = Fabric(accelerator="cpu")
    eager, compiled = Stack(), Stack()
    if block_class == "torch":
        for model in (eager, compiled):
            torch.manual_seed(0)
            model.layers = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(3))
    compile_blocks(compiled, backend=recording)
    runs = []
    for model in (eager, compiled):
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(1)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.module.out.weight.detach()))
    assert 1 <= len(graphs) <= 2, "each block compiled on its own instead of sharing one graph"
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    assert torch.allclose(runs[0][1], runs[1][1], atol=1e-5)
