"""fabric-deepspeed in one process, without importing deepspeed: registration, laziness, config, precision, formats.

Everything that needs DeepSpeed's engine runs on real ranks in ``test_deepspeed.py``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric_core import Fabric
from fabric_core.utilities.exceptions import MisconfigurationException
from fabric_deepspeed import config as ds_config

NAMES = [
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_1_offload",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme",
]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_registration_is_cheap_and_fabric_imports_no_deepspeed() -> None:
    code = (
        "import sys, fabric_core\n"
        "from fabric_core import Fabric\n"
        "Fabric(accelerator='cpu')\n"
        "from fabric_core.plugins import get_registry\n"
        "r = get_registry()\n"
        "names = [n for n in r.names('strategy') if n.startswith('deepspeed')]\n"
        "print(names, r.get('strategy', 'deepspeed').distribution)\n"
        "print(sorted(m for m in sys.modules if m == 'deepspeed' or m.startswith('deepspeed.')))\n"
        "print('fabric_deepspeed.strategy' in sys.modules)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines == [f"{NAMES} fabric-deepspeed", "[]", "False"]


def test_resolving_a_name_builds_the_strategy_without_importing_deepspeed() -> None:
    code = (
        "import sys\n"
        "from fabric_core import Fabric\n"
        "f = Fabric(accelerator='cpu', strategy='deepspeed_stage_3_offload', devices=2, precision='bf16-mixed')\n"
        "s = f.strategy\n"
        "print(type(s).__name__, s.zero_stage, type(s.precision).__name__, s.precision.precision)\n"
        "print(s.config['zero_optimization']['offload_param']['device'], s.requires_joint_setup, s.backward_sync_control)\n"
        "print(any(m == 'deepspeed' or m.startswith('deepspeed.') for m in sys.modules))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "DeepSpeedStrategy 3 DeepSpeedPrecision bf16-mixed",
        "cpu True None",
        "False",
    ]


def test_fabric_plugins_check_reports_every_name_available() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fabric_core", "plugins", "--check", "--json", "--kind", "strategy"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = json.loads(done.stdout)
    ours = {e["name"]: e["status"] for e in report["entries"] if e["distribution"] == "fabric-deepspeed"}
    assert ours == dict.fromkeys(NAMES, "available")
    plugin = next(p for p in report["plugins"] if p["distribution"] == "fabric-deepspeed")
    # Its precision is the strategy's own answer; its folders are read through its registered checkpoint format.
    assert sorted(plugin["decision_hooks"]) == []
    assert not any(f["distribution"] == "fabric-deepspeed" for f in report["failures"])


# ----------------------------------------------------------------------------------------------------- config
def _options(**changes):
    return {**ds_config.OPTION_DEFAULTS, **changes}


def test_default_config_is_the_references() -> None:
    cfg = ds_config.default_config(_options(stage=3, offload_optimizer=True, offload_parameters=True, logging_batch_size_per_gpu=4))
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["zero_allow_untested_optimizer"] is True
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True and zero["reduce_bucket_size"] == 200_000_000
    assert zero["offload_optimizer"] == {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": False}
    assert zero["offload_param"] == {
        "device": "cpu",
        "nvme_path": "/local_nvme",
        "buffer_count": 5,
        "buffer_size": 100_000_000,
        "max_in_cpu": 1_000_000_000,
        "pin_memory": False,
    }
    assert cfg["aio"]["block_size"] == 1048576 and cfg["activation_checkpointing"]["partition_activations"] is False
    # Below stage 2 there is nothing to overlap, and DeepSpeed refuses overlap_comm when the caller owns the step.
    assert "overlap_comm" not in ds_config.default_config(_options(stage=1))["zero_optimization"]
    assert "zero_optimization" not in ds_config.default_config(_options(zero_optimization=False))


def test_engine_config_adds_what_fabric_needs_without_overriding_the_user() -> None:
    base = ds_config.default_config(_options(stage=2, offload_optimizer=True))
    cfg = ds_config.engine_config(base, "bf16-mixed", "cpu", ds_config.FP16_OPTION_DEFAULTS)
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["managed_gradient_accumulation"] is False
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed 0.19 would clip at 1.0
    assert cfg["zero_force_ds_cpu_optimizer"] is False  # keep the user's torch optimizer when offloading on CPU
    assert "zero_force_ds_cpu_optimizer" not in ds_config.engine_config(base, "32-true", "cuda", {})
    assert "bf16" not in base  # a copy
    user = {"train_batch_size": 16, "gradient_clipping": 1.0, "managed_gradient_accumulation": True, "fp16": {"enabled": False}}
    kept = ds_config.engine_config(user, "32-true", "cpu", {})
    assert kept["gradient_clipping"] == 1.0 and kept["managed_gradient_accumulation"] is True
    assert "train_micro_batch_size_per_gpu" not in kept and "gradient_accumulation_steps" not in kept
    fp16 = ds_config.engine_config({}, "16-mixed", "cuda", ds_config.FP16_OPTION_DEFAULTS)
    assert fp16["fp16"] == {"enabled": True, **ds_config.FP16_OPTION_DEFAULTS}


def test_engine_config_refuses_what_deepspeed_would_reject_late() -> None:
    with pytest.raises(ValueError, match="not supported by DeepSpeed on the CPU"):
        ds_config.engine_config({}, "16-mixed", "cpu", {})
    with pytest.raises(ValueError, match="enables bf16, but the precision is '32-true'"):
        ds_config.engine_config({"bf16": {"enabled": True}}, "32-true", "cpu", {})
    with pytest.raises(ValueError, match="`overlap_comm: true` with ZeRO stage 1"):
        ds_config.engine_config({"zero_optimization": {"stage": 1, "overlap_comm": True}}, "32-true", "cpu", {})
    assert ds_config.engine_config({"bf16": {"enabled": True}}, "bf16-true", "cpu", {})["bf16"] == {"enabled": True}


def test_config_file_env_variable_and_bad_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric_deepspeed import DeepSpeedStrategy

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}))
    assert DeepSpeedStrategy(config=str(path)).zero_stage == 3
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    assert DeepSpeedStrategy().config["train_micro_batch_size_per_gpu"] == 2
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    with pytest.raises(MisconfigurationException, match="You passed in a path to a DeepSpeed config but the path does not exist"):
        DeepSpeedStrategy(config=str(tmp_path / "missing.json"))
    path.write_text("{not json")
    with pytest.raises(MisconfigurationException, match="is not valid JSON"):
        DeepSpeedStrategy(config=path)
    with pytest.warns(UserWarning, match="`stage`, `offload_optimizer` are ignored"):
        DeepSpeedStrategy(config={"zero_optimization": {"stage": 1}}, stage=3, offload_optimizer=True)


def test_strategy_options_and_plugins_are_validated() -> None:
    from fabric_core.io.checkpoint_io import CheckpointIO, TorchCheckpointIO
    from fabric_core.precision.half import HalfPrecision
    from fabric_deepspeed import DeepSpeedPrecision, DeepSpeedStrategy

    with pytest.raises(ValueError, match="`stage` must be 0, 1, 2 or 3"):
        DeepSpeedStrategy(stage=4)
    with pytest.raises(ValueError, match="`offload_parameters=True` needs ZeRO stage 3"):
        DeepSpeedStrategy(stage=2, offload_parameters=True)
    with pytest.raises(ValueError, match="`offload_optimizer_device` must be one of"):
        DeepSpeedStrategy(offload_optimizer_device="disk")
    with pytest.raises(TypeError, match="can only work with the `DeepSpeedPrecision` plugin"):
        DeepSpeedStrategy(precision=HalfPrecision("bf16-true"))
    with pytest.raises(TypeError, match=r"DeepSpeedPrecision\('bf16-true'\)"):
        Fabric(accelerator="cpu", strategy="deepspeed", devices=2, plugins=HalfPrecision("bf16-true"))
    strategy = DeepSpeedStrategy(precision=DeepSpeedPrecision("bf16-mixed"), logging_level=logging.ERROR)
    assert strategy.precision.precision == "bf16-mixed"

    class MyIO(CheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):  # pragma: no cover
            raise AssertionError

        def load_checkpoint(self, path, map_location=None, weights_only=None, mmap=False):  # pragma: no cover
            raise AssertionError

        def remove_checkpoint(self, path):  # pragma: no cover
            raise AssertionError

    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin"):
        Fabric(accelerator="cpu", strategy="deepspeed", devices=2, plugins=MyIO())
    strategy.checkpoint_io = TorchCheckpointIO()  # the default kind is fine


def test_the_deepspeed_strategy_chooses_its_own_precision() -> None:
    from fabric_core.accelerators.cpu import CPUAccelerator
    from fabric_core.plugins import get_registry
    from fabric_deepspeed import DeepSpeedPrecision

    registry = get_registry()
    cpu = CPUAccelerator()
    ds = registry.create("strategy", "deepspeed_stage_2")
    for name in ("32-true", "bf16-true", "bf16-mixed"):
        chosen = ds.precision_for(name, cpu)
        assert isinstance(chosen, DeepSpeedPrecision) and chosen.precision == name
    with pytest.raises(ValueError, match=r"`precision='64-true'\)` is not supported in DeepSpeed. `precision` must be one of"):
        ds.precision_for("64-true", cpu)
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        ds.precision_for("16-mixed", cpu)
    # No fabric-amp needed for the mixed names: the DeepSpeed strategy serves them.
    assert Fabric(accelerator="cpu", strategy="deepspeed", devices=2, precision="bf16-mixed").strategy.precision.precision == "bf16-mixed"


def test_precision_casts_inputs_for_the_engine_and_outputs_back() -> None:
    from fabric_deepspeed import DeepSpeedPrecision

    bf16 = DeepSpeedPrecision("bf16-mixed")
    x, ids = torch.randn(2, 3), torch.arange(3)
    cast = bf16.convert_input((x, ids))
    assert cast[0].dtype == torch.bfloat16 and cast[1].dtype == torch.int64
    assert bf16.convert_output(cast[0]).dtype == torch.float32
    assert bf16.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float32  # the engine casts it
    assert DeepSpeedPrecision("bf16-true").convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert DeepSpeedPrecision("32-true").convert_input(torch.zeros(1, dtype=torch.float64)).dtype == torch.float32
    assert bf16.requires_fabric_backward


# ----------------------------------------------------------------------------------------------------- formats
def test_checkpoint_directories_are_recognised_from_file_names(tmp_path: Path) -> None:
    from fabric_core.io.location import CheckpointLocation
    from fabric_core.plugins import get_registry
    from fabric_deepspeed.layout import is_deepspeed_checkpoint, tag_folder_parent

    ckpt = tmp_path / "ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    assert not is_deepspeed_checkpoint(ckpt)
    (ckpt / "latest").write_text("checkpoint")
    assert not is_deepspeed_checkpoint(ckpt)  # no model states yet
    (ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    assert is_deepspeed_checkpoint(ckpt)
    assert tag_folder_parent(ckpt / "checkpoint") == CheckpointLocation.of(ckpt)
    (tmp_path / "latest").write_text("../etc")
    assert not is_deepspeed_checkpoint(tmp_path)
    recognising = [f for f in (r.recognising(CheckpointLocation.of(ckpt)) for r in get_registry().registered_formats()) if f]
    assert [type(f).__name__ for f in recognising] == ["DeepSpeedFormat"]  # the registered format, asked directly
    assert not any(r.recognising(CheckpointLocation.of(tmp_path)) for r in get_registry().registered_formats())
