"""The connector's errors start with the words the well-known Fabric uses (so an existing ``pytest.raises(match=)``
keeps matching), keep its exception types, and end with our own guidance."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from fabric_core import Fabric
from fabric_core.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
from fabric_core.environments import PlainEnvironment
from fabric_core.io.checkpoint_io import TorchCheckpointIO
from fabric_core.plugins import reset_registry
from fabric_core.precision import DoublePrecision
from fabric_core.strategies import ParallelStrategy
from fabric_core.strategies.single_device import SingleDeviceStrategy
from fabric_core.utilities.rank_zero import set_rank

_VARS = ("FABRIC_PLUGINS", "FABRIC_CLI_USED", "FABRIC_ACCELERATOR", "FABRIC_STRATEGY", "FABRIC_DEVICES",
         "FABRIC_NUM_NODES", "FABRIC_PRECISION", "LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
         "SLURM_NTASKS", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # fmt: skip


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    saved = dict(os.environ)
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    yield
    reset_registry()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.skipif(CUDAAccelerator.is_available() or MPSAccelerator.is_available(), reason="needs a CPU-only machine")
def test_unavailable_accelerator():  # 7.11
    with pytest.raises(RuntimeError) as err:
        Fabric(accelerator="cuda")
    assert str(err.value) == (
        "`CUDAAccelerator` can not run on your system since the accelerator is not available. The following"
        " accelerator(s) is available and can be passed into `accelerator` argument of `Fabric`: ['cpu']."
    )


def test_invalid_accelerator_lists_auto_first_then_suggests():  # 7.12
    with pytest.raises(ValueError, match=re.escape("You selected an invalid accelerator name: `accelerator='cpux'`."
                                                   " Available names are: auto, cpu, cuda, mps.")) as err:
        Fabric(accelerator="cpux")
    assert "Did you mean 'cpu'?" in str(err.value).split("Available names are")[1]
    assert "`accelerator='gpu'` is accepted too" in str(err.value)
    with pytest.raises(ValueError, match="Did you mean 'auto'?"):
        Fabric(accelerator="autoo")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"strategy": SingleDeviceStrategy(accelerator=CPUAccelerator()), "accelerator": "cpu"},
         "accelerator set through both strategy class and accelerator flag, choose one"),
        ({"strategy": SingleDeviceStrategy(precision=DoublePrecision()), "plugins": DoublePrecision()},
         "precision set through both strategy class and plugins, choose one"),
        ({"strategy": SingleDeviceStrategy(checkpoint_io=TorchCheckpointIO()), "plugins": TorchCheckpointIO()},
         "checkpoint_io set through both strategy class and plugins, choose one"),
        ({"strategy": ParallelStrategy(cluster_environment=PlainEnvironment()), "plugins": PlainEnvironment(),
          "accelerator": "cpu"},
         "cluster_environment set through both strategy class and plugins, choose one"),
    ],
    ids=["accelerator", "precision", "checkpoint_io", "cluster_environment"],
)  # fmt: skip
def test_setting_given_twice(kwargs, words):  # 7.13-7.16
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        Fabric(**kwargs)
    assert str(err.value).endswith("Keep it on the strategy object or pass it to Fabric, not both.")


@pytest.mark.parametrize(
    ("device", "accelerator", "label"),
    [("cpu", "cuda", "CPU"), ("cpu", "gpu", "CPU"), ("cuda", "cpu", "GPU"), ("cpu", "mps", "CPU")],
)
def test_strategy_devices_of_another_type_than_the_accelerator_flag(device, accelerator, label):  # 7.17
    # Refused before the accelerator's availability is looked at: the conflict is the user's, whatever the machine.
    strategy = ParallelStrategy(parallel_devices=[torch.device(device)] * 2)
    with pytest.raises(ValueError, match=re.escape(
        f"{label} parallel_devices set through ParallelStrategy class, but accelerator set to {accelerator},"
        " please choose one device type"
    )):  # fmt: skip
        Fabric(strategy=strategy, accelerator=accelerator)


def test_strategy_devices_against_an_accelerator_object():
    strategy = ParallelStrategy(parallel_devices=[torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="GPU parallel_devices set through ParallelStrategy class"):
        Fabric(strategy=strategy, accelerator=CPUAccelerator())


def test_strategy_devices_decide_the_auto_accelerator():
    # On a GPU machine "auto" would pick cuda for the strategy's CPU processes; their type wins instead.
    fabric = Fabric(strategy=ParallelStrategy(parallel_devices=[torch.device("cpu")] * 2))
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.strategy.parallel_devices == [torch.device("cpu")] * 2
    assert fabric.world_size == 2


def test_precision_flag_and_plugin():  # 7.18
    with pytest.raises(ValueError, match=re.escape("Received both `precision=64-true` and `plugins=")) as err:
        Fabric(precision="64-true", plugins=DoublePrecision())
    assert "Choose one" in str(err.value)


def test_cli_conflict(monkeypatch):  # 7.19
    monkeypatch.setenv("FABRIC_CLI_USED", "1")
    monkeypatch.setenv("FABRIC_PRECISION", "64-true")
    with pytest.raises(ValueError, match=re.escape(
        "Your code has `Fabric(precision='bf16-true', ...)` but it conflicts with the value `--precision=64-true`"
        " set through the CLI.  Remove it either from the CLI or from the"
    )):  # fmt: skip
        Fabric(precision="bf16-true")


def test_interactive_session_and_a_launcher_that_reruns_the_script(monkeypatch):  # 7.20
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    with pytest.raises(RuntimeError, match=re.escape(
        "is not compatible with an interactive environment. Run your code as a script, or choose one of the"
        " compatible strategies: "
    )) as err:  # fmt: skip
        Fabric(accelerator="cpu", strategy=ParallelStrategy(), devices=2)
    assert "make sure to include the Fabric creation inside the worker function" in str(err.value)
    # With one device, `strategy="auto"` in a notebook picks single_device: that is the compatible choice named.
    with pytest.raises(RuntimeError, match=re.escape("compatible strategies: `Fabric(strategy='single_device')`")):
        Fabric(accelerator="cpu", strategy=ParallelStrategy(), devices=1)
