"""fabric-fsdp on real processes (gloo on CPU): training, sharding, meta init, checkpoints across layouts, CLI.

The expensive part is starting ranks, so each multi-process test runs one worker script that does many checks
and writes its measurements to JSON; the assertions live here. Scripts are in ``scripts/``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import read_json, run_ranks, run_script

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.append(str(SCRIPTS))  # for fsdp_common / fsdp_skeleton; appended so nothing else is shadowed
import fsdp_common as common  # noqa: E402  (the model and data the scripts use)


def _ddp_installed() -> bool:
    try:
        import fabric_ddp  # noqa: F401
    except ImportError:
        return False
    return True


def _tensors_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_states_equal(a: dict, b: dict) -> bool:
    if [g["params"] for g in a["param_groups"]] != [g["params"] for g in b["param_groups"]]:
        return False
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(
        torch.equal(torch.as_tensor(a["state"][k][n]), torch.as_tensor(b["state"][k][n])) for k in a["state"] for n in a["state"][k]
    )


def _consolidate(*argv: str) -> int:
    from fabric_core import cli

    return cli.main(["consolidate", *argv])


# ----------------------------------------------------------------------------------------------------- training
@pytest.mark.multiprocess
def test_training_checkpoints_and_bad_inputs(tmp_path: Path) -> None:
    """2 ranks train like the single-process reference; checkpoints move between 2 ranks, 1 rank, DDP, 1 device."""
    run_ranks(SCRIPTS / "train_checks.py", str(tmp_path), tmp_path=tmp_path)
    r = read_json(tmp_path / "result.json")

    # The default policy shards the TransformerEncoderLayer on its own, and the root.
    assert r["fsdp_units"] == ["", "enc"]
    # Joint setup rewired the optimizer created before sharding to the sharded parameters.
    assert r["optimizer_params_sharded"] and r["optimizer_params_are_model_params"]
    # Each rank holds half of the parameters (FSDP pads dim 0 to a multiple of the world size).
    assert sum(r["local_numel"]) >= r["full_numel"]
    assert all(n <= r["full_numel"] / 2 + 64 for n in r["local_numel"])

    # Training matches the single-process reference on the global batch, and the loss goes down.
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
    assert r["losses"][-1] < 0.5 * r["losses"][0]
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)  # global norm over all shards, before clipping
    assert r["norm_types"] == ["Tensor"]  # a plain tensor, not a DTensor
    assert r["param_diff_vs_reference"] < 1e-5
    # Inside no_backward_sync the gradients were not reduce-scattered (no sharded .grad yet) ...
    assert all(r["grads_after_no_sync"])
    # ... and the accumulated step still matched the reference (checked by the losses/norms above).

    # Sharded checkpoint: one data file per rank plus the index and meta.pt; overwriting swaps it whole.
    assert r["sharded_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert r["sharded_files_stable"] and r["leftovers"] == []
    assert r["load_remainder"] == [] and r["loaded_step"] == 5 and r["loaded_counter"] == 7
    assert r["reload_param_diff"] == 0.0
    assert r["after_step_diff"] == 0.0  # optimizer state (AdamW moments) restored exactly
    assert r["full_load_remainder"] == ["step"]
    assert r["full_load_param_diff"] == 0.0 and r["full_load_after_step_diff"] == 0.0

    # Bad inputs give clear errors and touch nothing.
    errors = r["errors"]
    assert "Found multiple FSDP models in the given state" in errors["two_models"]
    assert "Saving checkpoints with FSDP is limited to a single model" in errors["two_models"]
    assert errors["filter_sharded"].startswith("FSDP doesn't support loading sharded filtered checkpoints")
    assert "state_dict_type='full'" in errors["filter_sharded"]
    assert "setup_module" in errors["meta_joint_setup"]
    assert errors["stale_optimizer"].startswith("The optimizer does not seem to reference any FSDP parameters")
    assert "not an FSDP checkpoint" in errors["non_checkpoint_dir"]
    assert r["bad_dir_untouched"]
    assert "pickle" in errors["failed_save"]
    assert r["after_failed_save"] == {"files_unchanged": True, "leftovers": [], "old_step": 5, "old_params_diff": 0.0}

    # The full file is an ordinary torch checkpoint; the filter applied to it.
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert sorted(full) == ["counter", "model", "optimizer", "step"]
    assert full["counter"] == {"n": 7} and full["step"] == 5
    assert sorted(full["optimizer"]["state"]) == list(range(len(full["model"])))  # keyed by position
    filtered = torch.load(tmp_path / "filtered.ckpt", weights_only=True)
    assert filtered["model"] and all("bias" not in k for k in filtered["model"])

    # 2 ranks -> 1 rank (FSDP), full file -> FSDP, raw state dict -> FSDP; then save on 1 rank.
    run_ranks(SCRIPTS / "load_checks.py", str(tmp_path), "fsdp1", world_size=1, tmp_path=tmp_path)
    one = read_json(tmp_path / "load_fsdp1.json")
    assert one == {
        "remainder": ["counter"],
        "step": 5,
        "param_diff": 0.0,
        "optimizer_diff": 0.0,
        "full_param_diff": 0.0,
        "full_optimizer_diff": 0.0,
        "load_raw_param_diff": 0.0,
    }
    # 1 rank -> 2 ranks (FSDP); 2-rank sharded -> DDP through the core's loader hook; DDP file -> FSDP.
    run_ranks(SCRIPTS / "load_checks.py", str(tmp_path), "fsdp2", tmp_path=tmp_path)
    two = read_json(tmp_path / "load_fsdp2.json")
    assert two["step"] == 11 and two["param_diff"] == 0.0 and two["optimizer_diff"] == 0.0
    if _ddp_installed():
        assert two["ddp_step"] == 5 and two["ddp_param_diff"] == 0.0 and two["ddp_optimizer_diff"] == 0.0
        assert two["from_ddp_step"] == 12
        assert two["from_ddp_param_diff"] == 0.0 and two["from_ddp_optimizer_diff"] == 0.0
    else:
        assert two["ddp"] == "not installed"

    # The sharded checkpoint in a single-device Fabric: model and optimizer restored exactly.
    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = common.make_model(seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(tmp_path / "sharded", state)
    assert state["step"] == 5 and remainder == {"counter": {"n": 7}}
    assert _tensors_equal(model.state_dict(), full["model"])
    assert _optimizer_states_equal(optimizer.state_dict(), full["optimizer"])

    # `fabric consolidate` writes the same content as the full checkpoint.
    assert _consolidate(str(tmp_path / "sharded")) == 0
    consolidated = torch.load(tmp_path / "sharded.consolidated", weights_only=True)
    assert sorted(consolidated) == sorted(full)
    assert _tensors_equal(consolidated["model"], full["model"])
    assert _optimizer_states_equal(consolidated["optimizer"], full["optimizer"])

    # ... also for a folder at a URL, into a file beside it there.
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "sharded"), "/consolidate-test/sharded", recursive=True)
    assert _consolidate("memory://consolidate-test/sharded") == 0
    with fs.open("/consolidate-test/sharded.consolidated", "rb") as file:
        remote = torch.load(file, weights_only=True)
    assert sorted(remote) == sorted(full) and _tensors_equal(remote["model"], full["model"])


# ----------------------------------------------------------------------------------------------------- the seeds' loop
@pytest.mark.multiprocess
def test_seed_skeleton_meta_init_and_single_process_load(tmp_path: Path) -> None:
    """The documented loop with Fabric's own launcher; a meta-device model never exists in full on a rank."""
    output = run_script(SCRIPTS / "fsdp_skeleton.py", str(tmp_path), timeout=180, tmp_path=tmp_path)
    r = read_json(tmp_path / "skeleton.json")
    assert r["world_size"] == 2, output
    assert r["meta_before_setup"] and r["materialized"] and r["finite"]
    # Each rank allocated about half of the model while setting it up, never the whole of it.
    assert r["peak_reset"]
    budget = 0.75 * r["full_bytes"]
    assert all(0 < peak < budget for peak in r["setup_peak_bytes"]), (r["setup_peak_bytes"], budget)
    assert all(abs(n - r["full_numel"] / 2) <= 64 * 16 for n in r["local_numel"])
    assert r["shards_differ"]  # each shard initialised from its own seed
    losses = r["epoch_losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]

    # The sharded checkpoint loads into a plain single-process model with exactly the FSDP weights.
    from fsdp_skeleton import Model

    from fabric_core import Fabric

    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(Model())
    remainder = fabric.load(tmp_path / "skeleton_sharded", {"model": model})
    assert remainder["epoch"] == 4 and sorted(remainder) == ["epoch", "optimizer"]  # not requested: returned
    full = torch.load(tmp_path / "skeleton_full.ckpt", weights_only=True)
    assert _tensors_equal(model.state_dict(), full["model"])

    # The console script (a new process) consolidates; bad inputs exit 1 with a message.
    out_file = tmp_path / "one_file.ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "fabric_core", "consolidate", str(tmp_path / "skeleton_sharded"), "--output_file", str(out_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    consolidated = torch.load(out_file, weights_only=True)
    assert consolidated["epoch"] == 4 and _tensors_equal(consolidated["model"], full["model"])


def test_consolidate_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing"
    assert _consolidate(str(missing)) == 2  # a usage error, as the reference's command line has it
    assert "does not exist" in capsys.readouterr().err
    a_file = tmp_path / "file.ckpt"
    a_file.write_bytes(b"x")
    assert _consolidate(str(a_file)) == 1
    assert "not a folder" in capsys.readouterr().err
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    (plain_dir / "weights.pt").write_bytes(b"x")
    assert _consolidate(str(plain_dir)) == 1
    assert "not a checkpoint folder that an installed plugin can read" in capsys.readouterr().err
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ".metadata").write_bytes(b"")
    (fake / "meta.pt").write_bytes(b"")
    existing = tmp_path / "fake.consolidated"
    existing.write_bytes(b"keep")
    assert _consolidate(str(fake)) == 1
    assert "already exists" in capsys.readouterr().err
    assert existing.read_bytes() == b"keep"
    assert _consolidate(str(fake), "--output_file", str(tmp_path / "new.ckpt")) == 1  # recognised, unreadable
    assert "Could not read" in capsys.readouterr().err
    assert not (tmp_path / "new.ckpt").exists()


# ----------------------------------------------------------------------------------------------------- options
@pytest.mark.multiprocess
def test_strategy_options_and_precisions(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "variants.py", str(tmp_path), timeout=180, tmp_path=tmp_path)
    r = read_json(tmp_path / "variants.json")
    ref = r["ref_losses"]
    exact = ("blocks_checkpointed", "no_reshard", "hybrid", "replicated", "cpu_offload")
    for name in exact:
        assert r[name]["losses"] == pytest.approx(ref, rel=1e-5), name
        assert r[name]["param_diff"] < 1e-5, name
        assert r[name]["precision"] == "FSDPPrecision", name

    # Wrapping policy and activation checkpointing: each Block is a unit and runs forward twice per step.
    assert r["blocks_checkpointed"]["units"] == ["", "blocks.0", "blocks.1"]
    assert r["blocks_checkpointed"]["block_calls_per_step"] == 4
    assert r["no_reshard"]["block_calls_per_step"] == 2
    # Hybrid sharding on one node: a 2D mesh (replicate=1, shard=2). NO_SHARD replicates: full params per rank.
    assert r["hybrid"]["mesh"] == [1, 2] and r["hybrid"]["local_numel"] * 2 >= r["hybrid"]["full_numel"]
    assert r["replicated"]["mesh"] == [2, 1] and r["replicated"]["local_numel"] == r["replicated"]["full_numel"]
    assert r["replicated"]["meta_init_replicas_equal"]  # per-shard seeds, shared by the replicas of a shard
    assert r["cpu_offload"]["warnings"] and "no effect" in r["cpu_offload"]["warnings"][0]

    # Mixed precision: float32 master weights and outputs, losses close to the reference.
    for name in ("bf16_mixed", "fp16_mixed"):
        assert r[name]["param_dtype"] == "torch.float32" and r[name]["output_dtype"] == "torch.float32", name
        assert r[name]["losses"] == pytest.approx(ref, rel=2e-2), name
        assert r[name]["losses"][-1] < r[name]["losses"][0], name
    assert r["fp16_mixed"]["scaler"] == "ShardedGradScaler"
    assert r["fp16_mixed"]["scale_saved"] == r["fp16_mixed"]["scale"] > 0  # the scaler's state is checkpointed
    # bf16-true casts the weights themselves.
    assert r["bf16_true"]["param_dtype"] == "torch.bfloat16"
    assert r["bf16_true"]["losses"] == pytest.approx(ref, rel=2e-2)


@pytest.mark.multiprocess
def test_root_keeps_parameters_gathered_until_backward(tmp_path: Path) -> None:
    """`reshard_after_forward` applies to the wrapped units; the root follows torch's default (no resharding)."""
    run_ranks(SCRIPTS / "reshard_checks.py", str(tmp_path), tmp_path=tmp_path)
    r = read_json(tmp_path / "reshard.json")
    # Default (and an explicit None): the root stays gathered from forward to backward, the `enc` unit is freed.
    # All-gathers per step: root once (forward), enc twice (forward, backward).
    for name in ("default", "none"):
        assert r[name]["gathered_after_forward"] == {"root": True, "enc": False}, name
        assert r[name]["all_gathers_per_step"] == 3, name
    # fsdp_no_reshard: nothing is freed after forward anywhere, one all-gather per unit and step.
    assert r["no_reshard"]["gathered_after_forward"] == {"root": True, "enc": True}
    assert r["no_reshard"]["all_gathers_per_step"] == 2
    # Asking torch to reshard the root too works through the Fabric wrapper: one all-gather more.
    assert r["root_opt_in"]["gathered_after_forward"] == {"root": False, "enc": False}
    assert r["root_opt_in"]["all_gathers_per_step"] == 4
    for name, v in r.items():
        # Backward frees whatever forward kept gathered.
        assert v["sharded_after_step"], name
        # A forward under no_grad leaves the non-resharding units gathered (torch's behaviour) ...
        assert v["gathered_after_no_grad_forward"] == v["gathered_after_forward"], name
        # ... and the step after it must not leave them stale: the next forward uses the updated weights.
        assert v["forward_after_step_diff"] < 1e-6, name


# ----------------------------------------------------------------------------------------------------- GPU
@pytest.mark.multiprocess
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_seed_skeleton_on_two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_TEST_ACCELERATOR", "cuda")
    output = run_script(SCRIPTS / "fsdp_skeleton.py", str(tmp_path), timeout=300, tmp_path=tmp_path)
    r = read_json(tmp_path / "skeleton.json")
    assert r["world_size"] == 2, output
    assert r["materialized"] and r["finite"] and r["shards_differ"]
    assert all(0 < peak < 0.75 * r["full_bytes"] for peak in r["setup_peak_bytes"])
    assert r["epoch_losses"][-1] < r["epoch_losses"][0]


# ----------------------------------------------------------------------------------------------------- in-process
def test_registration_is_cheap_and_complete() -> None:
    code = (
        "import sys, fabric_fsdp.register\n"
        "from fabric_core.plugins import get_registry\n"
        "r = get_registry()\n"
        "names = [n for n in r.names('strategy') if n.startswith('fsdp')]\n"
        "heavy = [m for m in ('torch.distributed.fsdp', 'torch.distributed.checkpoint', 'fabric_fsdp.strategy') if m in sys.modules]\n"
        "print(names, heavy, r.get('strategy', 'fsdp').distribution)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['fsdp', 'fsdp_cpu_offload', 'fsdp_hybrid', 'fsdp_no_reshard'] [] fabric-fsdp"


def test_the_fsdp_strategy_chooses_its_own_precision() -> None:
    from fabric_core.accelerators.cpu import CPUAccelerator
    from fabric_core.plugins import get_registry
    from fabric_fsdp import FSDPPrecision, FSDPStrategy

    registry = get_registry()
    cpu = CPUAccelerator()
    fsdp = registry.create("strategy", "fsdp")
    assert isinstance(fsdp, FSDPStrategy)
    for name in ("32-true", "bf16-true", "16-true"):
        chosen = fsdp.precision_for(name, cpu)
        assert isinstance(chosen, FSDPPrecision) and chosen.precision == name
    assert fsdp.precision_for("64-true", cpu) is None  # the registered 64-true: FSDP2 shards the model as it is
    assert "fabric_select_precision" not in {c.name for c in registry.plugin_manager.get_hookcallers(
        registry.plugin_manager.get_plugin("fsdp")) or []}  # fmt: skip

    mixed = FSDPPrecision("bf16-mixed")
    policy = mixed.mixed_precision_policy(root=True)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.output_dtype == torch.float32 and mixed.mixed_precision_policy(root=False).output_dtype is None
    assert FSDPPrecision("bf16-true").mixed_precision_policy() is None
    assert not mixed.requires_fabric_backward
    with pytest.raises(ValueError, match=r"`precision='64-true'` is not supported in FSDP. `precision` must be one of"):
        FSDPPrecision("64-true")


def test_strategy_arguments_are_validated() -> None:
    from fabric_fsdp import FSDPStrategy

    with pytest.raises(ValueError, match="state_dict_type"):
        FSDPStrategy(state_dict_type="local")
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDPStrategy(sharding_strategy="ZERO_4")
    with pytest.raises(ValueError, match="device_mesh"):
        FSDPStrategy(device_mesh=(2, 0))
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        FSDPStrategy(auto_wrap_policy={"Linear"})
    strategy = FSDPStrategy(sharding_strategy="shard_grad_op")
    assert strategy.reshard_after_forward is False


def test_optimizer_state_key_conversion_round_trips() -> None:
    from fabric_fsdp.checkpoint import optimizer_state_by_name, optimizer_state_by_position

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    params = list(model.parameters())
    optimizer = torch.optim.Adam([{"params": params[2:]}, {"params": params[:2], "lr": 0.5}])
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    native = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = optimizer_state_by_name(native, optimizer, names)
    assert [g["params"] for g in by_name["param_groups"]] == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    assert optimizer_state_by_position(by_name)["state"].keys() == native["state"].keys()
    assert json.dumps([g["params"] for g in optimizer_state_by_position(by_name)["param_groups"]]) == "[[0, 1], [2, 3]]"
    with pytest.raises(ValueError, match="same parameters"):
        optimizer_state_by_name(native, torch.optim.Adam(params[:2]), names)


@pytest.mark.multiprocess
def test_a_rank_dying_during_a_sharded_save_leaves_the_previous_checkpoint_and_no_temp(tmp_path):
    """The surviving rank's agreement collective fails; its cleanup runs in `finally`, so nothing is left behind."""
    import subprocess
    import sys

    from jobs import free_port, job_env

    from fabric_core.io.commit import is_temporary
    from fabric_fsdp.checkpoint import load_sharded_checkpoint

    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = job_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # fmt: skip
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPTS / "save_faults.py"), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    try:
        codes = [p.wait(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    outputs = [p.stdout.read() for p in ranks]
    assert codes == [3, 7], outputs
    assert (tmp_path / "error0").read_text().strip(), "rank 0 must fail with an error, not hang or succeed"
    assert [p.name for p in tmp_path.iterdir() if is_temporary(p)] == []
    assert load_sharded_checkpoint(tmp_path / "ckpt")["step"] == 1  # the previous checkpoint, complete


@pytest.mark.multiprocess
def test_load_raw_into_modules_that_rename_keys_while_loading(tmp_path: Path) -> None:
    """A full checkpoint into an FSDP model whose LoRA-style layers rename keys in a load_state_dict pre-hook."""
    run_ranks(SCRIPTS / "renaming_load.py", str(tmp_path), timeout=180, tmp_path=tmp_path)
    for rank in (0, 1):
        result = read_json(tmp_path / f"rename{rank}.json")
        assert result["diff"] == 0.0, result
        assert "Missing key(s)" in result["strict_error"] and "lora_b" in result["strict_error"], result
