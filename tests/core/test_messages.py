"""Default info messages and possible-user warnings, as a user sees them in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest

from fabric_core.utilities.rank_zero import PossibleUserWarning, rank_zero_warn


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "POSSIBLE_USER_WARNINGS")}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=clean, timeout=120)


def test_info_messages_are_shown_by_default():
    pytest.importorskip("fabric_amp", reason="the AMP message comes from fabric-amp (not installed in the XLA lane)")
    done = _python(
        """
        from fabric_core import Fabric, seed_everything
        seed_everything(42)
        Fabric(accelerator="cpu", precision="bf16-mixed")
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "Seed set to 42" in lines  # no rank prefix in a plain single process
    assert "Using bfloat16 Automatic Mixed Precision (AMP)" in lines


def test_the_seed_message_names_the_rank_when_the_process_is_one_of_several():
    done = _python("from fabric_core import seed_everything; seed_everything(7)", RANK="1")
    assert "[rank: 1] Seed set to 7" in done.stderr.splitlines()


def test_an_application_that_configures_logging_gets_the_messages_through_its_own_handlers():
    done = _python(
        """
        import logging
        logging.basicConfig(format="APP %(name)s %(message)s", level=logging.WARNING)
        from fabric_core import seed_everything
        seed_everything(3)
        logging.getLogger("fabric_core").setLevel(logging.WARNING)  # and it can silence them
        seed_everything(4)
        """
    )
    lines = done.stderr.splitlines()
    assert lines.count("APP fabric_core.utilities.seed Seed set to 3") == 1 and "Seed set to 3" not in lines
    assert not any("Seed set to 4" in line for line in lines)


def test_possible_user_warnings_are_silenced_by_the_variable():
    code = """
        import warnings
        warnings.simplefilter("always")
        import fabric_core
        from fabric_core.utilities.rank_zero import PossibleUserWarning, rank_zero_warn
        rank_zero_warn("probably a mistake", category=PossibleUserWarning)
        rank_zero_warn("a real warning")
        """
    loud = _python(code)
    quiet = _python(code, POSSIBLE_USER_WARNINGS="off")
    assert "probably a mistake" in loud.stderr and "a real warning" in loud.stderr
    assert "probably a mistake" not in quiet.stderr and "a real warning" in quiet.stderr
    assert "probably a mistake" not in _python(code, POSSIBLE_USER_WARNINGS="0").stderr


def test_disable_possible_user_warnings():
    from fabric_core import disable_possible_user_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        rank_zero_warn("probably a mistake", category=PossibleUserWarning)
        rank_zero_warn("kept")
    assert [str(w.message) for w in caught] == ["kept"]


@pytest.mark.multiprocess
def test_distributed_start_is_announced(tmp_path):
    pytest.importorskip("fabric_ddp")
    import os

    from jobs import free_port

    port = free_port()
    script = tmp_path / "job.py"
    script.write_text("from fabric_core import Fabric\nFabric(accelerator='cpu', strategy='ddp', devices=2).launch()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in lines
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in lines
    assert lines.count("All distributed processes registered. Starting with 2 processes") == 1  # rank zero only


def test_tensor_cores_hint_as_the_reference_gives_it():
    from fabric_core.accelerators.cuda import tensor_cores_hint

    hint = tensor_cores_hint("NVIDIA H100", (9, 0), "highest")
    assert hint.startswith("You are using a CUDA device ('NVIDIA H100') that has Tensor Cores.")
    assert "torch.set_float32_matmul_precision('medium' | 'high')" in hint
    assert tensor_cores_hint("Tesla V100", (7, 0), "highest") is None  # no Tensor Cores for float32 there
    assert tensor_cores_hint("NVIDIA A100", (8, 0), "high") is None  # already chosen
