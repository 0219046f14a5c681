"""fabric-deepspeed with the real deepspeed package on real processes (gloo on CPU).

The expensive part is starting ranks and building engines, so each multi-process test runs one worker script that
does many checks and writes its measurements to JSON; the assertions live here. Scripts are in ``scripts/``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import fabric_command, job_env, read_json, run_job, run_ranks

from fabric_core.runtime.ledger import report

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.append(str(SCRIPTS))  # for ds_common; appended so nothing else is shadowed
import ds_common as common  # noqa: E402


def test_stages_precisions_offload_and_the_seeds_rules(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "train_checks.py", str(tmp_path), timeout=240, tmp_path=tmp_path)
    r = read_json(tmp_path / "train.json")
    assert r["world_size"] == 2
    runs = r["runs"]
    reference = common.reference_losses(6, 2, accumulate_at=2)
    # float32: every stage, with and without offload, is the single-process reference on the global batch (the
    # stage-2 run accumulates two micro-batches at step 2, which must not change anything).
    for name in ("stage1_fp32", "stage2_fp32", "stage3_fp32", "stage2_offload", "stage3_offload"):
        assert runs[name]["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6), name
        assert runs[name]["param_dtype"] == "torch.float32", name
    for name, run in runs.items():
        assert run["losses"][-1] < 0.8 * run["losses"][0], name  # training works
        assert run["precision"] == "DeepSpeedPrecision", name
        assert run["optimizer"] == "FabricOptimizer", name
        assert run["engine_steps"] == 6, name  # every optimizer.step() is an optimizer step
        assert run["managed_accumulation"] is False, name
    # bf16: the engine holds bf16 parameters, inputs are cast for it and outputs come back as float32.
    for name in ("stage2_bf16", "stage3_bf16", "stage3_bf16_true"):
        assert runs[name]["param_dtype"] == "torch.bfloat16", name
        assert runs[name]["output_dtype"] == "torch.float32", name
        assert runs[name]["losses"] == pytest.approx(reference, rel=2e-2), name

    # Several models: backward needs `model=`, and each optimizer steps its own engine.
    errors = r["errors"]
    assert errors["backward_without_model"] == "No models were set up for backward. Did you forget to call `fabric.setup()`?"
    assert errors["ambiguous_backward"].startswith(
        "When using multiple models + deepspeed, please provide the model used to perform the optimization:"
        " `self.backward(loss, model=model)`"
    )
    assert r["step_moves_only_its_model"] == {"a_changed": False, "b_changed": True}
    assert r["a_changed_after_its_step"]
    assert "`fabric.backward(loss)` instead of `loss.backward()`" in errors["plain_backward"]
    assert r["no_backward_sync_warnings"] == [
        "The `DeepSpeedStrategy` does not support skipping the gradient synchronization. Remove"
        " `.no_backward_sync()` from your code or choose a different strategy."
    ]
    for key in ("clip_norm", "clip_value"):
        assert errors[key].startswith("DeepSpeed handles gradient clipping automatically within the optimizer.")
        assert "'gradient_clipping'" in errors[key]
    assert errors["setup_optimizers"].startswith(
        "The `DeepSpeedStrategy` requires the model and optimizer(s) to be set up jointly through `.setup(model,"
        " optimizer, ...)`."
    )
    assert "Got 2 optimizers instead" in errors["two_optimizers"]
    assert "closure" in errors["closure"]

    # A model set up alone evaluates exactly like the plain model (stage 3: partitioned, gathered per forward).
    assert r["setup_module_stage2_diff"] == 0.0 and r["setup_module_stage3_diff"] == 0.0
    # init_module under stage 3: nothing is held locally; each rank holds half of every parameter.
    zero_init = r["zero_init"]
    assert zero_init["local_numel"] == 0 and zero_init["partition_numel"] * 2 >= zero_init["full_numel"]
    assert zero_init["partition_numel"] <= zero_init["full_numel"] / 2 + 16
    assert "empty_init=False" in errors["empty_init_false"]
    assert "nvme_path='/local_nvme'" in errors["nvme_path"] and "not a writable directory" in errors["nvme_path"]


# ----------------------------------------------------------------------------------------------------- checkpoints
def _consolidate_in_subprocess(*folders: Path) -> list[subprocess.CompletedProcess]:
    """``fabric consolidate`` through the console script (a new process: deepspeed is not imported here)."""
    return [
        subprocess.run([sys.executable, "-m", "fabric_core", "consolidate", str(f)], capture_output=True, text=True, timeout=180)
        for f in folders
    ]


def test_checkpoints_resume_exactly_consolidate_and_load_everywhere(tmp_path: Path) -> None:
    """At the same size, on other strategies and, optimizer state included, on 3 and then 1 rank (2 -> 3 -> 1)."""
    run_ranks(SCRIPTS / "checkpoint_checks.py", str(tmp_path), "save", timeout=240, tmp_path=tmp_path)
    saved = read_json(tmp_path / "checkpoint_save.json")
    # DeepSpeed's layout, committed as a whole (no temporary entries, the old checkpoint replaced at once).
    assert saved["files"] == [
        "checkpoint",
        "checkpoint/mp_rank_00_model_states.pt",
        "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    faults = saved["faults"]
    assert faults["files_unchanged"] and faults["leftovers"] == [] and faults["leftovers_after_twice"] == []
    assert faults["twice"] == saved["files"]
    errors = saved["errors"]
    assert errors["filter"].startswith("`DeepSpeedStrategy.save_checkpoint(..., filter=...)` is not supported")
    assert errors["storage_options"].startswith("`DeepSpeedStrategy.save_checkpoint(..., storage_options=...)` is not supported")
    assert "async_save=True" in errors["async"] and "fabric.save(path, state)" in errors["async"]
    assert "limited to a single model per checkpoint" in errors["two_models"]
    assert errors["no_model"].startswith("Could not find a DeepSpeed model in the provided checkpoint state")
    assert "pickle" in errors["unpicklable"].lower() or "lambda" in errors["unpicklable"]
    assert "not a DeepSpeed checkpoint" in errors["user_dir"]
    assert "nothing exists there" in errors["load_missing"]
    assert "load the directory that holds it" in errors["load_tag_folder"]
    assert "a state with at least" in errors["load_empty_state"]
    assert "'nope'" in errors["load_unknown_key"]
    assert "ZeRO optimizer is not supported" in errors["load_raw_optimizer"]
    # load_raw: a plain state dict goes into the engine and its master weights (stage 2 and 3).
    for name in ("load_raw_s2", "load_raw_s3"):
        assert saved[name]["loaded"] == saved[name]["direct"] and saved[name]["weights_diff"] == 0.0, name

    # Fresh processes, other seeds: loading and continuing gives exactly the uninterrupted run's losses.
    run_ranks(SCRIPTS / "checkpoint_checks.py", str(tmp_path), "resume", timeout=240, tmp_path=tmp_path)
    resumed = read_json(tmp_path / "checkpoint_resume.json")
    for name in ("s1", "s2", "s3", "s2_bf16", "s3_bf16"):
        assert resumed[name]["after"] == saved[name]["after"], name
        assert resumed[name]["remainder"] == [] and resumed[name]["step"] == 4 and resumed[name]["counter"] == 7, name
        assert resumed[name]["lr"] == pytest.approx([1e-2 * 0.9**4]), name  # the scheduler's state came back
    assert resumed["model_only"] == {"remainder": ["counter", "scheduler", "step"], "diff": 0.0}

    # Consolidation: one float32 state dict equal to the live weights (bf16: equal once cast to bf16).
    done = _consolidate_in_subprocess(tmp_path / "ck_s3", tmp_path / "ck_s2_bf16")
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    for name, exact in (("s3", True), ("s2_bf16", False)):
        consolidated = torch.load(tmp_path / f"ck_{name}.consolidated", weights_only=True)
        live = torch.load(tmp_path / f"live_{name}.pt", weights_only=True)
        assert sorted(consolidated) == ["counter", "model", "scheduler", "step"]
        weights = consolidated["model"]
        assert set(weights) == set(live) and all(v.dtype == torch.float32 for v in weights.values())
        for key, value in live.items():
            expected = value if exact else value.to(torch.bfloat16)
            got = weights[key] if exact else weights[key].to(torch.bfloat16)
            assert torch.equal(got.to(expected.dtype), expected), (name, key)
        model = common.make_model(5)
        model.load_state_dict(weights)  # into the plain model, strict

    # The same directory loads into DDP and FSDP (2 ranks), a single device and a 1-rank engine; on 3 ranks (grow)
    # and then 1 (shrink, in the job of load_elsewhere.py one) the resize checks load the optimizer state too.
    run_ranks(SCRIPTS / "load_elsewhere.py", str(tmp_path), "two", timeout=180, tmp_path=tmp_path)
    run_ranks(SCRIPTS / "resize_checks.py", str(tmp_path), "grow", world_size=3, timeout=300, tmp_path=tmp_path)
    run_ranks(SCRIPTS / "load_elsewhere.py", str(tmp_path), "one", world_size=1, timeout=240, tmp_path=tmp_path)
    elsewhere = {**read_json(tmp_path / "elsewhere_two.json"), **read_json(tmp_path / "elsewhere_one.json")}
    for name in ("ddp", "fsdp", "single_device", "deepspeed_stage_2"):
        if elsewhere[name] == "not installed":
            continue
        assert elsewhere[name] == {"remainder": ["counter", "scheduler", "step"], "diff": 0.0}, name
    assert "saved on 2 ranks and is loaded on 1 with ZeRO stage 3 into ZeRO stage 2" in elsewhere["optimizer_error"]
    assert "deepspeed_stage_3" in elsewhere["optimizer_error"]
    _check_resized(tmp_path)


def _check_resized(tmp_path: Path) -> None:
    """2 -> 3 -> 1 ranks, ZeRO 2 and 3 (fp32) and ZeRO 3 (bf16): every loaded tensor, gathered, equals the saved one
    (float32 master weights, model weights, a buffer, a frozen parameter, Adam's state, step counters, the learning
    rate), and training goes on with the uninterrupted run's losses (``global_batch_size``: the same global batches at
    every size) and every sample of the epoch once (the sample ledger)."""
    saved, grown, shrunk = (read_json(tmp_path / f"resize_{p}.json") for p in ("save", "grow", "shrink"))
    for name in ("s2", "s3", "s3_bf16"):
        for before, after in (("save", "grow"), ("grow", "shrink")):
            expected = torch.load(tmp_path / f"state_{name}_{before}_saved.pt", weights_only=True)
            loaded = torch.load(tmp_path / f"state_{name}_{after}_loaded.pt", weights_only=True)
            assert sorted(loaded) == sorted(expected) and len(expected) == 33, (name, after)
            differ = {k: float((v.double() - loaded[k].double()).abs().max()) for k, v in expected.items() if not torch.equal(v, loaded[k])}
            assert not differ, (name, after, differ)
        assert (grown[name]["world"], shrunk[name]["world"]) == (3, 1)
        assert (grown[name]["step"], shrunk[name]["step"]) == (3, 5) and grown[name]["remainder"] == []
        # the same global batches as the uninterrupted 2-rank run: its losses, up to the order of the reductions
        tolerance = {"rel": 2e-3} if name.endswith("bf16") else {"rel": 1e-5}
        assert grown[name]["losses"] + shrunk[name]["losses"] == pytest.approx(saved[name]["after"], **tolerance), name
        # the elastic recipe's loader and generators went with the checkpoint: every sample of the epoch once
        ledger = report(tmp_path / f"ledger_{name}")
        summary = ledger.as_dict()["loaders"]["loader0"]
        assert ledger.ok and summary["resumes"] == [[0, 18], [0, 30]], ledger.text()
        assert summary["epochs"]["0"]["trained"] == summary["epochs"]["0"]["size"] == 42 and ledger.rolled_back == 8  # 4 steps x 2 ranks
        assert len(set(grown[name]["draws"])) == 3, grown[name]["draws"]  # every rank's generators its own
    refusals = grown["s2"]["refusals"]
    assert refusals["unchanged"]
    errors = refusals["errors"]
    assert "Adam-style optimizers" in errors["momentum"] and "['momentum_buffer']" in errors["momentum"]
    assert "saved on 2 ranks and is loaded on 3" in errors["momentum"]
    assert "`elastic_checkpoint: true`" in errors["elastic"] and "Save without `elastic_checkpoint`" in errors["elastic"]
    assert "(rank 0: " in errors["corrupt"] and "Load it on as many ranks as saved it" in errors["corrupt"]
    assert "'extra.bias', 'extra.weight'" in errors["other_model"] and "Load a checkpoint of this model" in errors["other_model"]
    assert [r["scratch_left"] for r in (saved, grown, shrunk)] == [[], [], []]
    # every resized load converted on local rank 0, once (the corrupt one too), except the one converted ahead
    assert grown["conversions"] == ["ck_s2_save", "ck_corrupt", "ck_s3_save", "ck_s3_bf16_save"]
    assert shrunk["conversions"] == ["ck_s2_grow", "ck_s3_bf16_grow"]


# ----------------------------------------------------------------------------------------------------- the seeds' loop
SKELETON = SCRIPTS / "ds_skeleton.py"
# With mmap for every allocation above 64 KiB, freed tensors go back to the OS, so the resident-set peak measures
# what was alive at once (glibc would otherwise keep freed 4 MiB blocks in its heap).
_MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def test_seed_skeleton_stage_3_partitions_at_construction_and_consolidates(tmp_path: Path) -> None:
    job, code = run_job([sys.executable, SKELETON, tmp_path, "3"], tmp_path / "log", 240, env=job_env(**_MEASURE_ENV))
    assert code == 0, job.output()[-4000:]
    r = read_json(tmp_path / "skeleton_3.json")
    assert (r["world_size"], r["strategy"], r["stage"]) == (2, "DeepSpeedStrategy", 3)
    assert r["local_numel"] == 0  # every parameter partitioned as it was built
    # Building inside init_module peaks at about half the model (this rank's partitions) plus one layer, while a
    # plain build holds the whole model.
    for plain, init in zip(r["plain_peak_bytes"], r["init_module_peak_bytes"]):
        assert plain > 0.9 * r["full_bytes"]
        assert init < 0.75 * r["full_bytes"], (init, r["full_bytes"])
    losses = r["epoch_losses"]
    assert losses[-1] < losses[0]

    # The console script consolidates the directory into one file that loads into the plain model.
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fabric"), "consolidate", str(tmp_path / "skeleton_3")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    from ds_skeleton import Model

    consolidated = torch.load(tmp_path / "skeleton_3.consolidated", weights_only=True)
    live = torch.load(tmp_path / "skeleton_3_live.pt", weights_only=True)
    assert consolidated["epoch"] == 3
    Model().load_state_dict(consolidated["model"])
    assert all(torch.equal(consolidated["model"][k], v) for k, v in live.items())


def test_fabric_run_deepspeed_stage_2(tmp_path: Path) -> None:
    command = [*fabric_command(), "--accelerator", "cpu", "--strategy", "deepspeed_stage_2", "--devices", "2", SKELETON]
    job, code = run_job([*command, tmp_path, "2", "--cli"], tmp_path / "log", 240, env=job_env(**_MEASURE_ENV))
    assert code == 0, job.output()[-4000:]
    r = read_json(tmp_path / "skeleton_2.json")
    assert (r["world_size"], r["stage"]) == (2, 2)
    assert r["epoch_losses"][-1] < r["epoch_losses"][0]
    assert (tmp_path / "skeleton_2" / "latest").read_text() == "checkpoint"


def test_a_failing_rank_ends_the_job(tmp_path: Path) -> None:
    job, code = run_job([sys.executable, SKELETON, tmp_path, "2"], tmp_path / "log", 180, env=job_env(SKELETON_FAIL_AT="2"))
    assert code != 0
    output = job.output()
    assert "rank 1 fails on purpose" in output
    assert not (tmp_path / "skeleton_2.json").exists()
