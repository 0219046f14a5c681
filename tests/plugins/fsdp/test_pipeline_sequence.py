"""``model_parallel``'s pipeline and sequence (Ulysses) axes on real gloo processes, and their checks in this process.

Each multi-process run is one worker script doing every check of its layout (``scripts/pipeline_checks.py``,
``scripts/sequence_checks.py``); the assertions live here. fp32 throughout: every loss and gradient within 1e-5 of one
process running the whole model on the same data.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from jobs import read_json, run_ranks
from torch import nn

from fabric_core import Fabric, cli

SCRIPTS = Path(__file__).parent / "scripts"
TOLERANCE = 1e-5


def _close(record: dict) -> None:
    assert record["loss"] == pytest.approx(record["ref_loss"], abs=TOLERANCE)
    assert max(record["grad_diff"]) < TOLERANCE
    assert record["param_diff"] < TOLERANCE


def _expected(folder: Path, world: int) -> tuple[dict, dict]:
    model: dict = {}
    optimizer: dict = {}
    for rank in range(world):
        part = torch.load(folder / f"expected_rank{rank}.pt", weights_only=True)
        model.update(part["model"])
        optimizer.update(part["optimizer"])
    return model, optimizer


def _pipeline_two_ranks(r: dict, tmp_path: Path) -> None:
    # Every schedule, split by names or by a function: loss and every gradient of one process, twice (AdamW and
    # clipping by the whole model's norm over both stages in between), the same loss returned on both ranks.
    assert set(r["schedules"]) == {"GPipe", "1F1B", "1F1B_function", "Interleaved1F1B", "LoopedBFS"}
    for name, record in r["schedules"].items():
        _close(record)
        for norm, ref_norm in record["norms"]:
            assert norm == pytest.approx(ref_norm, rel=TOLERANCE), name
        assert record["same_loss_on_every_rank"], name
    # Rank 0 keeps its stages only, under the full model's names, and so does its optimizer.
    assert r["held"]["1F1B"] == sorted(f"{m}.{p}" for m in ["inp", *(f"layers.{i}.{x}" for i in (0, 1) for x in ("up", "down"))] for p in ("weight", "bias"))
    interleaved = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers") else "") for n in r["held"]["Interleaved1F1B"]}
    assert interleaved == {"inp", "layers.0", "layers.2"}  # stages 0 and 2 of 4
    assert all(r["optimizer_holds_own"].values())
    # The sharded checkpoint lists the whole model, loads exactly into data parallel 2 x pipeline 1 (model and AdamW).
    assert r["checkpoint_keys"] == sorted(dict(_net().named_parameters()))
    assert r["dp2_remainder"] == {"step": 2} and r["dp2_loads_exactly"] and r["dp2_optimizer_exactly"]
    # ... and into one process (a plain Fabric reads the folder whole), exactly; `fabric consolidate` makes one file.
    expected_model, expected_optimizer = _expected(tmp_path, 2)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    assert fabric.load(tmp_path / "pipeline_ckpt", {"model": model, "optimizer": optimizer}) == {"step": 2}
    state = model.state_dict()
    assert set(state) == set(expected_model) and all(torch.equal(state[k], v) for k, v in expected_model.items())
    names = [n for n, _ in model.module.named_parameters()]
    saved = optimizer.state_dict()["state"]
    assert all(torch.equal(saved[names.index(k)][s], v) for k, entry in expected_optimizer.items() for s, v in entry.items())
    assert cli.main(["consolidate", str(tmp_path / "pipeline_ckpt")]) == 0
    consolidated = torch.load(tmp_path / "pipeline_ckpt.consolidated", weights_only=True)
    assert all(torch.equal(consolidated["model"][k], v) for k, v in expected_model.items()) and consolidated["step"] == 2
    # Errors that need a running pipeline; a smaller batch builds a schedule of its own and is right.
    assert "`layers.0` receives something computed from the previous piece's output" in r["chain_error"]
    assert "pipeline_split=fn(model, stage_index, num_stages)" in r["chain_error"]
    assert "not `model(x)`" in r["direct_call_error"]
    assert "batch has 6 samples" in r["uneven_error"]
    assert "needs at least as many micro-batches as pipeline ranks (2), got 1" in r["few_micro_batches_error"]
    assert "needs `target=`" in r["no_target_error"]
    assert r["smaller_batch_loss"] == pytest.approx(r["smaller_batch_ref_loss"], abs=TOLERANCE)


def _sequence(r: dict, tmp_path: Path, world: int) -> None:
    dp = world // 2
    assert r["mesh"] == [["data_parallel", "sequence", "tensor_parallel"], [dp, 2, 1]]
    assert r["sampler"] == [dp, 0]  # sequence peers read the same samples
    assert r["axes"] == [["data_parallel", dp, "data_shard"], ["sequence", 2, "sequence"], ["tensor_parallel", 1, "tensor"]]
    _close(r["steps"])  # SDPA and the user's attention through the all-to-all, unevenly ignored tokens, micro-batches
    assert "The sequence has 7 positions" in r["length_error"] and "multiple of 2" in r["length_error"]
    assert "`query` has 1 head(s)" in r["heads_error"]
    assert "sequence_positions=None" in r["positions_error"]
    if world == 2:  # the sequence-sharded checkpoint loads into one process under the full names, exactly
        expected = torch.load(tmp_path / "sequence_expected.pt", weights_only=True)
        sequence = runpy.run_path(str(SCRIPTS / "sequence_checks.py"), run_name="loaded")
        fabric = Fabric(accelerator="cpu", devices=1)
        model = fabric.setup_module(sequence["TinyLM"]())
        assert fabric.load(tmp_path / "sequence_ckpt", {"model": model}) == {"step": 2}
        state = model.state_dict()
        assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.multiprocess
def test_pipeline_and_sequence_on_two_ranks(tmp_path: Path) -> None:
    """Pipeline 2 (every schedule, checkpoints, errors), then sequence parallel 2, in one 2-process job."""
    run_ranks(SCRIPTS / "pipeline_checks.py", str(tmp_path), "2", world_size=2, tmp_path=tmp_path, timeout=300)
    r = read_json(tmp_path / "result.json")
    _pipeline_two_ranks(r, tmp_path)
    _sequence(r, tmp_path, world=2)


@pytest.mark.multiprocess
def test_pipeline_and_sequence_times_data_parallel(tmp_path: Path) -> None:
    """Pipeline 2 x data parallel 2, then sequence parallel 2 x data parallel 2, in one 4-process job."""
    run_ranks(SCRIPTS / "pipeline_checks.py", str(tmp_path), "4", world_size=4, tmp_path=tmp_path, timeout=300)
    r = read_json(tmp_path / "result.json")
    # (pipeline, data_parallel, tensor_parallel) coordinates, row-major; samplers split over the 2 data rows only.
    assert r["pipeline_coordinates"] == [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert r["pipeline_sampler"] == [2, 0]
    # The topology publishes the mesh's axes with their roles; only the data axis splits the data.
    assert r["pipeline_axes"] == [["pipeline", 2, "pipeline"], ["data_parallel", 2, "data_shard"], ["tensor_parallel", 1, "tensor"]]
    assert r["pipeline_data_parallel"] == [2, 0, 0]
    _close(r["pp2_dp2"])
    assert r["pp2_dp2"]["sharded"]  # every stage's parameters are FSDP2 shards over its data rows
    _sequence(r, tmp_path, world=4)


# ----------------------------------------------------------------------------------------------------- in-process
def _net() -> nn.Module:
    return runpy.run_path(str(SCRIPTS / "pipeline_checks.py"), run_name="net")["Net"]()


def _shard_nothing(model, mesh):
    return model


def test_pipeline_and_sequence_options_are_checked_where_they_are_given() -> None:
    from fabric_fsdp import ModelParallelStrategy
    from fabric_fsdp.pipeline import MicroBatchError, PipelineSplitError

    with pytest.raises(PipelineSplitError, match=r"1 split point\(s\), so it cuts the model into 2 stage\(s\), but the pipeline runs 4"):
        ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_split=["layers.2"])
    with pytest.raises(PipelineSplitError, match="needs `pipeline_split`"):
        ModelParallelStrategy(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"Unknown `pipeline_schedule='ZeroBubble'`. Choose one of 'GPipe', '1F1B'"):
        ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["a"], pipeline_schedule="ZeroBubble")
    with pytest.raises(MicroBatchError, match="at least as many micro-batches as pipeline ranks \\(4\\), got 2"):
        ModelParallelStrategy(pipeline_parallel_size=4, pipeline_split=["a", "b", "c"], pipeline_micro_batches=2)
    with pytest.raises(MicroBatchError, match="e.g. one of"):
        ModelParallelStrategy(
            pipeline_parallel_size=2, pipeline_split=["a", "b", "c"], pipeline_schedule="Interleaved1F1B", pipeline_micro_batches=5
        )
    with pytest.raises(ValueError, match="runs one stage per rank, but `pipeline_stages_per_rank=2`"):
        ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["a", "b", "c"], pipeline_stages_per_rank=2)
    with pytest.raises(ValueError, match="`pipeline_split` given, but `pipeline_parallel_size=1`"):
        ModelParallelStrategy(_shard_nothing, pipeline_split=["a"])
    with pytest.raises(NotImplementedError, match="Pipeline and sequence parallelism together"):
        ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["a"], sequence_parallel_size=2)
    with pytest.raises(ValueError, match="saves sharded checkpoints only"):
        ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["a"], save_distributed_checkpoint=False)
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=["a"])
    with pytest.raises(ValueError, match="saves sharded checkpoints only"):
        strategy.state_dict_type = "full"
    with pytest.raises(ValueError, match="`sequence_parallel_size` must be a positive integer, got 'auto'"):
        ModelParallelStrategy(sequence_parallel_size="auto")
    with pytest.raises(ValueError, match="`sequence_dim` must be"):
        ModelParallelStrategy(sequence_parallel_size=2, sequence_dim=0)
    # A split given as an import string is loaded; no parallelize_fn is needed with a model axis.
    by_name = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_split=f"{__name__}:_split_in_two")
    assert by_name._pipeline[0] is _split_in_two and by_name._parallelize_fn is None
    with pytest.raises(ValueError, match=r"`tensor_parallel_size=2` needs a `parallelize_fn"):
        Fabric(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(sequence_parallel_size=2, tensor_parallel_size=2))


def _split_in_two(model, stage, num_stages):
    return model


def test_mesh_sizes_and_layout_with_model_axes() -> None:
    from fabric_fsdp.model_parallel import mesh_layout, mesh_sizes

    assert mesh_sizes("auto", "auto", 1, 4, pipeline_parallel=2) == (2, 1)  # the model axes leave data parallel 2
    assert mesh_sizes("auto", 2, 1, 8, pipeline_parallel=2) == (2, 2)
    assert mesh_sizes(1, "auto", 1, 4, sequence_parallel=2) == (1, 2)
    with pytest.raises(ValueError, match=r"`data_parallel_size=3` and `tensor_parallel_size=1` x `pipeline_parallel_size=2`"):
        mesh_sizes(3, 1, 1, 4, pipeline_parallel=2)
    assert mesh_layout(2, 2, 1, 1) == [("pipeline", 2), ("data_parallel", 2), ("tensor_parallel", 1)]
    assert mesh_layout(1, 2, 2, 1) == [("data_parallel", 2), ("sequence", 2), ("tensor_parallel", 1)]
    assert mesh_layout(1, 2, 1, 2) == [("data_parallel", 2), ("tensor_parallel", 2)]  # the 2-D mesh as before


def test_split_by_names_cuts_the_chain_and_keeps_full_names() -> None:
    from fabric_fsdp.pipeline import Chain, Elsewhere, split_model

    torch.manual_seed(0)
    model = _net()
    reference = _net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 6)
    stages, indices, check, names = split_model(model, ["layers.1", "layers.3"], pipeline_rank=1, pipeline_size=3, stages_per_rank=1)
    assert indices == [1] and isinstance(stages[0], Chain)
    assert [n for n, _ in stages[0].named_parameters()] == [n for n, _ in model.named_parameters()]
    assert {n.rsplit(".", 2)[0] for n, _ in model.named_parameters()} == {"layers.1", "layers.2"}
    assert isinstance(model.inp, Elsewhere) and isinstance(model.head, Elsewhere) and isinstance(model.layers[0], Elsewhere)
    assert names[0] == "inp.weight" and len(names) == len(list(reference.parameters()))
    # the middle stage computes what the same layers compute in the whole model
    h = reference.layers[0](reference.inp(x))
    assert torch.equal(stages[0](h), reference.layers[2](reference.layers[1](h)))
    check.verify((x,), {})  # the model is a chain
    with pytest.raises(RuntimeError, match="`inp` belongs to pipeline stage 0"):
        model.inp(x)


def test_split_errors_say_what_to_change() -> None:
    from fabric_fsdp.pipeline import ChainCheck, PipelineSplitError, clone_on_meta, split_model

    def split(model, names, **kw):
        options = {"pipeline_rank": 0, "pipeline_size": len(names) + 1, "stages_per_rank": 1, **kw}
        return split_model(model, names, **options)

    with pytest.raises(PipelineSplitError, match="names 'layers.9', which is not a submodule of Net"):
        split(_net(), ["layers.9"])
    with pytest.raises(PipelineSplitError, match="in the order the model runs them"):
        split(_net(), ["layers.3", "layers.1"])
    with pytest.raises(PipelineSplitError, match="names 'layers' and one of its submodules"):
        split(_net(), ["layers", "layers.2"])
    with pytest.raises(PipelineSplitError, match="after its first piece"):
        split(_net(), ["inp"])
    tied = _net()
    tied.layers[3].up.weight = tied.layers[0].up.weight
    with pytest.raises(PipelineSplitError, match=r"`layers.0.up.weight` \(also `layers.3.up.weight`\) is in stage 0 and in stage 1 \(tied weights\?\)"):
        split(tied, ["layers.2"])
    with pytest.raises(PipelineSplitError, match="not one of the model's own"):
        split_model(_net(), lambda m, i, n: nn.Linear(2, 2), pipeline_rank=0, pipeline_size=2, stages_per_rank=1)
    with pytest.raises(PipelineSplitError, match=r"leave out parameters of the model \(\['inp.weight', 'inp.bias'"):
        split_model(_net(), lambda m, i, n: m.layers[i], pipeline_rank=0, pipeline_size=2, stages_per_rank=1)
    with pytest.raises(PipelineSplitError, match="must return the stage as an `nn.Module`"):
        split_model(_net(), lambda m, i, n: None, pipeline_rank=0, pipeline_size=2, stages_per_rank=1)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x)) + x  # a residual around the pieces

    check = ChainCheck(clone_on_meta(Twice()), ["a", "b"])
    with pytest.raises(PipelineSplitError, match="returns something computed from the last piece's output"):
        check.verify((torch.ones(1, 2),), {})
    with pytest.raises(PipelineSplitError, match="runs each stage as `x = piece\\(x\\)`, so the model takes one input"):
        ChainCheck(None, ["a", "b"]).verify((torch.ones(1, 2), torch.ones(1)), {})
