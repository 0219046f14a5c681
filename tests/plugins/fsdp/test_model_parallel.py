"""``model_parallel`` (``ModelParallelStrategy``): tensor parallel x FSDP2 by the user's ``parallelize_fn`` on real
gloo processes: 2 (tensor parallel 2) and 4 (data parallel 2 x tensor parallel 2), plus one process in this one.

Each multi-process run is one worker script (``scripts/model_parallel_checks.py``) doing every check; the assertions
live here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import read_json, run_ranks

from fabric_core import cli

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "sizes", "shape"), [(2, "auto", (1, 2)), (4, "2x2", (2, 2))], ids=["tp2", "dp2xtp2"])
def test_model_parallel_end_to_end(tmp_path: Path, world: int, sizes: str, shape: tuple[int, int]) -> None:
    run_ranks(SCRIPTS / "model_parallel_checks.py", str(tmp_path), str(world), sizes, world_size=world, tmp_path=tmp_path, timeout=300)
    r = read_json(tmp_path / "result.json")
    assert (r["world"], r["dp"], r["tp"]) == (world, *shape)
    # parallelize_fn received the 2-D mesh, named as the reference names it.
    assert r["meshes"] == [[["data_parallel", "tensor_parallel"], list(shape)]]
    # The sampler splits data over the mesh's rows: tensor-parallel peers read the same batches.
    assert r["sampler"][0] == shape[0] and r["peers_same_batches"]
    # Accumulation under no_backward_sync, clipping and AdamW steps match one process on the global batch.
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
    assert r["norm_types"] == ["Tensor"]
    assert r["param_diff"] < 1e-5
    # init_module(empty_init=True): built on meta, materialised per shard, replicated tensors agree across peers.
    assert r["built_on_meta"] and r["materialized_finite"] and r["replicated_bias_agrees"]
    # Sharded checkpoint: loads bit-exactly and the next step is identical (optimizer state came back too).
    assert r["sharded_remainder"] == {"step": 3}
    assert r["sharded_loaded_equal"] and r["sharded_resume_bit_exact"]
    # Full checkpoint: one file of whole tensors, loaded back into the shards.
    assert r["full_file_is_whole"] and r["full_loaded_equal"]
    # Both layouts load into `fsdp`, and `fabric consolidate` turns the sharded folder into the full model.
    assert r["fsdp_loads_sharded"] and r["fsdp_loads_full.ckpt"]
    assert cli.main(["consolidate", str(tmp_path / "sharded")]) == 0
    consolidated = torch.load(tmp_path / "sharded.consolidated", weights_only=True)
    expected = torch.load(tmp_path / "sharded_expected.pt", weights_only=True)
    assert set(consolidated["model"]) == set(expected) and all(torch.equal(consolidated["model"][k], v) for k, v in expected.items())
    assert consolidated["step"] == 3 and set(consolidated["optimizer"]["state"]) == set(range(len(expected)))
    assert "`data_parallel_size=3` and `tensor_parallel_size=" in r["product_error"]
    assert "must return a `nn.Module` instance, but got: NoneType" in r["return_error"]
    if shape[0] > 1:
        assert "fully_shard(module, mesh=device_mesh['data_parallel'])" in r["unsynchronised_error"]


# ----------------------------------------------------------------------------------------------------- in-process
def _shard_nothing(model, mesh):
    return model


def test_mesh_sizes_follow_the_reference_rules() -> None:
    from fabric_fsdp.model_parallel import mesh_sizes

    assert mesh_sizes("auto", "auto", num_nodes=1, processes_per_node=4) == (1, 4)  # tensor parallel inside a node
    assert mesh_sizes("auto", "auto", num_nodes=2, processes_per_node=4) == (2, 4)  # data parallel across nodes
    assert mesh_sizes(2, "auto", num_nodes=1, processes_per_node=8) == (2, 4)
    assert mesh_sizes("auto", 1, num_nodes=1, processes_per_node=4) == (4, 1)  # pure FSDP
    assert mesh_sizes(1, 1, num_nodes=1, processes_per_node=1) == (1, 1)  # one device
    with pytest.raises(ValueError, match=r"`data_parallel_size=3` and `tensor_parallel_size=2` multiplied should equal"):
        mesh_sizes(3, 2, num_nodes=1, processes_per_node=4)


def test_arguments_and_names_are_checked_where_they_are_given() -> None:
    from fabric_core import Fabric
    from fabric_fsdp import ModelParallelStrategy

    with pytest.raises(ValueError, match=r"needs a `parallelize_fn\(model, device_mesh\)`.*import string"):
        Fabric(accelerator="cpu", strategy="model_parallel", devices=2)
    with pytest.raises(ValueError, match="`tensor_parallel_size` must be 'auto' or a positive integer, got 0"):
        ModelParallelStrategy(_shard_nothing, tensor_parallel_size=0)
    with pytest.raises(TypeError, match="`parallelize_fn` must be a callable or an import string"):
        ModelParallelStrategy(42)
    # A strategy registered by name carries the function as an import string.
    by_name = ModelParallelStrategy(f"{__name__}:_shard_nothing")
    assert by_name._parallelize_fn is _shard_nothing
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`"):
        Fabric(accelerator="cpu", strategy=ModelParallelStrategy(_shard_nothing), devices=2, precision="16-mixed")
    fabric = Fabric(accelerator="cpu", strategy=ModelParallelStrategy(_shard_nothing), devices=2, precision="bf16-true")
    assert fabric.strategy.precision.precision == "bf16-true"
    with pytest.raises(RuntimeError, match="builds its device mesh when the processes start"):
        fabric.strategy.device_mesh  # noqa: B018


def test_one_device_trains_and_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (1, 1) mesh in this process: parallelize_fn runs, training and a sharded save/load work."""
    from jobs import free_port
    from torch.distributed.fsdp import fully_shard

    from fabric_core import Fabric
    from fabric_fsdp import ModelParallelStrategy

    def parallelize(model, mesh):
        assert mesh.mesh_dim_names == ("data_parallel", "tensor_parallel") and tuple(mesh.shape) == (1, 1)
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = Fabric(accelerator="cpu", strategy=ModelParallelStrategy(parallelize), devices=1)
    fabric.launch()
    try:
        torch.manual_seed(0)
        model = fabric.setup_module(torch.nn.Linear(3, 2))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
        before = model.weight.full_tensor().clone()
        fabric.backward(model(torch.ones(4, 3)).sum())
        optimizer.step()
        assert not torch.equal(model.weight.full_tensor(), before)
        fabric.save(tmp_path / "ckpt", {"model": model})
        restored = fabric.setup_module(torch.nn.Linear(3, 2))
        fabric.load(tmp_path / "ckpt", {"model": restored})
        assert torch.equal(restored.weight.full_tensor(), model.weight.full_tensor())
    finally:
        fabric.teardown()
