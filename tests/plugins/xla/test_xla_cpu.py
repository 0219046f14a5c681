"""fabric-xla on torch_xla's CPU PJRT device (``make test-xla``): real XLA, one fresh process per scenario.

Each scenario is a script in ``scripts/`` that runs in its own process with ``PJRT_DEVICE=CPU`` (and
``CPU_NUM_DEVICES`` for several devices) under a timeout: the XLA runtime's device type, device count and SPMD mode
are fixed for the life of a process, a CPU backward before the runtime starts breaks XLA backwards
(pytorch/xla#4174), and ``torch_xla.launch`` refuses a process whose runtime already runs. The scripts write JSON;
the assertions live here. Without torch_xla (the main venv) the module is skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("torch_xla") is None:
    pytest.skip(
        "torch_xla is not installed here: the XLA lane (`make test-xla`) runs these in .venv-xla with torch 2.9",
        allow_module_level=True,
    )

from jobs import read_json, run_script  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
#: Generous: importing torch_xla alone takes 2-8 s on a busy 2-core machine, and every scenario compiles graphs.
TIMEOUT = 300
#: Eager CPU and XLA:CPU run the same float32 math; measured differences are below 1e-6 (losses) here.
LOSS_TOLERANCE = {"rel": 1e-5, "abs": 1e-5}


def _run(script: str, tmp_path: Path, devices: int = 1) -> None:
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2"}
    run_script(SCRIPTS / script, str(tmp_path), timeout=TIMEOUT, tmp_path=tmp_path, env=env)


def test_single_device_training_checkpoint_and_precisions(tmp_path: Path) -> None:
    _run("single_checks.py", tmp_path)
    r = read_json(tmp_path / "single.json")
    assert r["runtime_started_by_fabric"]  # before any backward of the user's (pytorch/xla#4174)
    assert (r["strategy"], r["precision"], r["device"], r["world_size"]) == ("SingleDeviceXLAStrategy", "XLAPrecision", "xla:0", 1)

    # Fabric(accelerator="tpu") trains like plain PyTorch on the CPU
    assert r["losses"] == pytest.approx(r["ref_losses"], **LOSS_TOLERANCE)
    assert r["param_diff"] < 1e-5
    # the optimizer built before setup points at the moved parameters; batches arrive on the device
    assert r["optimizer_params_are_model_params"] and r["params_on_xla"]
    assert (r["batch_device"], r["loader_len"], r["loader_batch_size"]) == ("xla:0", 4, 16)
    # setup_module + setup_optimizers works as well (same losses as the first epoch of the joint setup)
    assert r["separate_setup_losses"] == pytest.approx(r["ref_losses"][:4], **LOSS_TOLERANCE)
    assert r["init_module_device"] == "xla:0"

    assert r["no_backward_sync_warnings"] == []  # a no-op, and silent
    assert r["clip_norm_finite"]
    assert r["all_reduce_sum"] == r["all_reduce_mean"] == r["all_gather"] == [1.0, 5.0]
    assert r["broadcast"] == {"a": 1}
    assert "only support `sum`, `mean`, `avg`" in r["all_reduce_max"]

    # save/load: CPU tensors on disk, loadable by plain PyTorch; the restored run continues identically
    assert r["checkpoint_all_cpu"] and r["checkpoint_keys"] == ["model", "optimizer", "step"]
    assert r["load_remainder"] == {"step": 8}
    assert r["restored_param_diff"] == 0.0 and r["restored_state_device"] == "xla:0"
    assert r["restored_continued"] == r["continued"]
    assert r["plain_model_matches"]

    # bf16-true: bfloat16 weights; bf16-mixed: float32 weights, bfloat16 compute; both train like float32
    assert r["bf16-true"]["precision"] == "XLAPrecision:bf16-true"
    assert (r["bf16-true"]["param_dtype"], r["bf16-true"]["inner_dtype"]) == ("torch.bfloat16", "torch.bfloat16")
    assert r["bf16-mixed"]["precision"] == "XLAPrecision:bf16-mixed"
    assert (r["bf16-mixed"]["param_dtype"], r["bf16-mixed"]["inner_dtype"]) == ("torch.float32", "torch.bfloat16")
    for name in ("bf16-true", "bf16-mixed"):
        assert r[name]["output_dtype"] == "torch.float32"  # outputs cast back, as the core's precisions do
        assert r[name]["losses"] == pytest.approx(r["sgd_ref_losses"], abs=2e-2)


@pytest.mark.parametrize("devices", [2, 4])
def test_spmd_sharding_matches_the_single_device_reference(tmp_path: Path, devices: int) -> None:
    _run("spmd_checks.py", tmp_path, devices=devices)
    r = read_json(tmp_path / f"spmd-{devices}.json")
    assert (r["strategy"], r["world_size"], r["sampler_kwargs"]) == ("XLAFSDPStrategy", 1, None)
    for prefix in ("", "wrapped_"):
        shardings = r[prefix + "param_shardings"]
        every_device = ",".join(map(str, range(devices))) + "}"
        assert all(s.startswith("{devices=[") and s.endswith(every_device) for s in shardings), shardings
        assert str(devices) in r[prefix + "input_sharding"] and r[prefix + "input_sharding"].startswith(f"{{devices=[{devices},1]")
        assert r[prefix + "label_sharding"] == f"{{devices=[{devices}]{every_device}"
        assert all(s != "" for s in r[prefix + "state_shardings"])
        # the sharded run computes what one device computes on the same global batches
        assert r[prefix + "losses"] == pytest.approx(r["ref_losses"], **LOSS_TOLERANCE)
        assert r[prefix + "param_diff"] < 1e-5
        # checkpoint: whole CPU tensors under the plain model's keys; loads back sharded, and into a CPU model
        assert r[prefix + "checkpoint_keys"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert r[prefix + "checkpoint_shapes_whole"] and r[prefix + "checkpoint_all_cpu"]
        assert r[prefix + "plain_param_diff"] == 0.0
        assert r[prefix + "load_remainder"] == {"step": 8} and r[prefix + "restored_param_diff"] == 0.0
        assert r[prefix + "restored_param_shardings"] == shardings
        assert all(s != "" for s in r[prefix + "restored_state_shardings"])  # no full-size optimizer state copies
        assert r[prefix + "restored_continued"] == pytest.approx(r[prefix + "continued"], rel=1e-6, abs=1e-6)
    assert r["units"] == 1 and r["wrapped_units"] == 4  # the root, plus the three Linear layers of the policy


def test_seed_skeleton_trains_on_one_xla_device(tmp_path: Path) -> None:
    _run("skeleton.py", tmp_path)
    r = read_json(tmp_path / "skeleton.json")
    assert (r["strategy"], r["device"]) == ("SingleDeviceXLAStrategy", "xla:0")
    assert r["losses"] == pytest.approx(r["ref_losses"], **LOSS_TOLERANCE)
    assert r["param_diff"] < 1e-5
    assert r["losses"][-1] < r["losses"][0]
    assert r["checkpoint_all_cpu"]


def test_multi_replica_launch_and_ranks(tmp_path: Path) -> None:
    """Launch and ranks only: collectives between CPU replicas are not reliable upstream (pytorch/xla#9089)."""
    # multiprocess-check: single process (torch_xla's CPU replicas are threads of one process)
    _run("replicas.py", tmp_path, devices=2)
    r = read_json(tmp_path / "replicas.json")
    assert (r["strategy"], r["world_size_before_launch"]) == ("XLAStrategy", 2)
    assert not r["runtime_started_before_launch"]
    assert r["launch_without_function"].startswith("To spawn processes with the `XLAStrategy` strategy, `.launch()`")
    assert (r["result_rank"], r["result_tensor_device"]) == (0, "cpu")
    replicas = r["replicas"]
    assert [x["rank"] for x in replicas] == [0, 1] and [x["local_rank"] for x in replicas] == [0, 1]
    assert [x["device"] for x in replicas] == ["xla:0", "xla:1"]
    assert [x["is_global_zero"] for x in replicas] == [True, False]
    assert all(x["world_size"] == 2 and x["node_rank"] == 0 for x in replicas)
    assert [x["sampler_kwargs"] for x in replicas] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]
    assert all(x["value"] == [0.0, 2.0, 4.0] for x in replicas)
    assert replicas[0]["fabric_object"] != replicas[1]["fabric_object"]  # threads get their own Fabric copy
    assert r["single_result"] == {"rank": 0, "world_size": 1} and r["single_ran_here"]


def test_a_backward_before_the_xla_device_is_a_clear_error(tmp_path: Path) -> None:
    """pytorch/xla#4174: after a CPU backward, every XLA backward fails an internal assert deep in autograd. Fabric
    checks once when it starts the runtime and says what to do."""
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run_script(SCRIPTS / "autograd_order.py", str(tmp_path), "cpu_backward_first", timeout=TIMEOUT, tmp_path=tmp_path, env=env)
    r = read_json(tmp_path / "order.json")
    assert r["error_type"] == "XLAAutogradOrderError" and r["is_runtime_error"], r
    assert "A backward pass ran in this process before the XLA device was first used" in r["error"]
    assert "before anything in this process calls `backward()`" in r["error"] and "fresh process" in r["error"]
    assert "device_ready_queues_" in r["cause"]  # torch_xla's own assert stays attached as the cause

    run_script(SCRIPTS / "autograd_order.py", str(tmp_path), "fabric_first", timeout=TIMEOUT, tmp_path=tmp_path, env=env)
    r = read_json(tmp_path / "order.json")
    assert r["grad_on_xla"].startswith("xla")
