"""Built-in accelerators: device parsing, availability, device setup, and how Fabric resolves them."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fabric_core import Fabric
from fabric_core.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator
from fabric_core.accelerators.cpu import CPU_DEVICES_MESSAGE, parse_cpu_devices
from fabric_core.accelerators.cuda import DEVICE_IDS_TYPE_MESSAGE, parse_gpu_ids
from fabric_core.plugins import get_registry, reset_registry
from fabric_core.utilities.exceptions import DeviceIdError, MisconfigurationException, NoDevicesAvailableError
from fabric_core.utilities.rank_zero import set_rank


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in ("FABRIC_PLUGINS", "FABRIC_CLI_USED", "FABRIC_ACCELERATOR", "FABRIC_DEVICES", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    set_rank(0)
    yield
    reset_registry()


# ---------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize(("devices", "count"), [("auto", 1), (1, 1), (3, 3), ("2", 2), (" 4 ", 4), ("1", 1)])
def test_cpu_parse_devices(devices, count):
    assert parse_cpu_devices(devices) == count
    assert CPUAccelerator().parse_devices(devices) == [torch.device("cpu")] * count


@pytest.mark.parametrize("devices", [0, "0", [], False])
def test_cpu_zero_devices(devices):
    with pytest.raises(ValueError, match=re.escape(f"`Fabric(devices={devices!r})` value is not a valid input using cpu")):
        CPUAccelerator().parse_devices(devices)


@pytest.mark.parametrize("devices", [-1, "-1", -3, [0], [0, 1], (1,), None, 1.0, True, "two", "1,2"])
def test_cpu_devices_must_be_a_positive_count(devices):
    # One message for every value that is not a count, as the reference has, then what was passed.
    with pytest.raises(TypeError, match=re.escape(CPU_DEVICES_MESSAGE) + f" Got {re.escape(repr(devices))}:"):
        CPUAccelerator().parse_devices(devices)
    assert CPU_DEVICES_MESSAGE == "`devices` selected with `CPUAccelerator` should be an int > 0."


@pytest.mark.parametrize("devices", [np.int64(3), torch.tensor(3)])
def test_cpu_accepts_any_integer_type(devices):
    assert parse_cpu_devices(devices) == 3


def test_cpu_accelerator_basics():
    accelerator = CPUAccelerator()
    assert accelerator.name == "cpu" and accelerator.device_type == "cpu"
    assert accelerator.distributed_backend == "gloo"
    assert CPUAccelerator.is_available() is True
    assert CPUAccelerator.auto_device_count() == 1
    accelerator.setup_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="Device should be CPU, got cuda instead."):
        accelerator.setup_device(torch.device("cuda", 0))
    accelerator.teardown()
    assert isinstance(accelerator, Accelerator)


# ---------------------------------------------------------------------------------------------------- GPU id parsing


@pytest.mark.parametrize(
    ("devices", "available", "ids"),
    [
        ("auto", 4, [0, 1, 2, 3]),
        (2, 4, [0, 1]),
        (-1, 3, [0, 1, 2]),
        ("-1", 3, [0, 1, 2]),
        ("2", 4, [0, 1]),
        ("1, 3", 4, [1, 3]),
        ("1,0", 2, [1, 0]),
        ("0,", 1, [0]),
        ([1, 3], 4, [1, 3]),
        ((2,), 4, [2]),
    ],
)
def test_parse_gpu_ids(devices, available, ids):
    assert parse_gpu_ids(devices, available) == ids


@pytest.mark.parametrize("devices", [0, "0", [], " 0 "])
def test_parse_gpu_ids_no_devices(devices):
    with pytest.raises(ValueError, match=re.escape(f"`Fabric(devices={devices!r})` value is not a valid input using GPU")):
        parse_gpu_ids(devices, 4)


@pytest.mark.parametrize("devices", [-2, "-2"])
def test_parse_gpu_ids_negative_count(devices):
    with pytest.raises(DeviceIdError, match="pass a count > 0, -1 for all devices"):
        parse_gpu_ids(devices, 4)


@pytest.mark.parametrize(
    ("devices", "passed"),
    [
        (["0"], "a sequence of str."),
        ([False], "a sequence of bool."),
        (["GPU"], "a sequence of str."),
        ([0.0], "a sequence of float."),
        ([0, "1"], "a sequence of str."),
        ((1, True), "a sequence of bool."),
        (None, "None."),
        (1.5, "1.5."),
        (True, "True."),
        ({0: 1}, "{0: 1}."),
    ],
)
def test_parse_gpu_ids_refuses_what_is_not_an_int(devices, passed):
    # Entries are not converted: int("0") or int(False) would silently pick device 0.
    with pytest.raises(TypeError, match=re.escape(f"{DEVICE_IDS_TYPE_MESSAGE} {passed}")) as err:
        parse_gpu_ids(devices, 4)
    assert "`devices=[0, 1]`" in str(err.value)  # then how to write it


@pytest.mark.parametrize(
    ("devices", "ids"),
    [([np.int64(1), np.int32(0)], [1, 0]), (np.int64(2), [0, 1]), ([torch.tensor(3)], [3]), (torch.tensor(-1), [0, 1, 2, 3])],
)
def test_parse_gpu_ids_accepts_any_integer_type(devices, ids):
    assert parse_gpu_ids(devices, 4) == ids
    assert all(type(i) is int for i in parse_gpu_ids(devices, 4))


def test_parse_gpu_ids_errors():
    with pytest.raises(ValueError, match="Could not parse `devices='x'`"):
        parse_gpu_ids("x", 4)
    with pytest.raises(ValueError, match="Could not parse `devices='0,a'`"):
        parse_gpu_ids("0,a", 4)
    with pytest.raises(DeviceIdError, match=re.escape("Device ID's (GPU) must be unique. Got [0, 0]")):
        parse_gpu_ids([0, 0], 4)
    with pytest.raises(DeviceIdError, match=re.escape("You requested gpu: [0, 5]\n But your machine only has: [0, 1]")):
        parse_gpu_ids([0, 5], 2)
    with pytest.raises(DeviceIdError, match=re.escape("You requested gpu: [0, 1, 2]\n")):
        parse_gpu_ids(3, 2)
    with pytest.raises(NoDevicesAvailableError, match="GPUs requested but none are available."):
        parse_gpu_ids(1, 0)
    with pytest.raises(NoDevicesAvailableError, match="GPUs requested but none are available."):
        parse_gpu_ids(-1, 0)


@pytest.mark.parametrize(
    ("devices", "available", "builtin"),
    [([1, 1], 4, ValueError), ([7], 4, ValueError), (-5, 4, ValueError), (2, 0, RuntimeError)],
)
def test_gpu_id_errors_are_the_reference_type_and_ours(devices, available, builtin):
    """`except MisconfigurationException` (the reference's type) and our builtin type both catch them."""
    with pytest.raises(MisconfigurationException) as err:
        parse_gpu_ids(devices, available)
    assert isinstance(err.value, builtin)
    assert MisconfigurationException.__bases__ == (Exception,)


def test_parse_gpu_ids_trusts_torchelastic(monkeypatch):
    # Under torchrun each process may see one GPU while asking for the index of its own: skip the check.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    assert parse_gpu_ids([3], 1) == [3]


def test_cuda_and_mps_availability_here():
    assert CUDAAccelerator.is_available() == (torch.cuda.is_available() and torch.cuda.device_count() > 0)
    assert CUDAAccelerator.auto_device_count() == torch.cuda.device_count()
    assert CUDAAccelerator.name == "cuda" and CUDAAccelerator.distributed_backend == "nccl"
    assert MPSAccelerator.auto_device_count() == 1


def test_mps_can_be_disabled(monkeypatch):
    monkeypatch.setenv("DISABLE_MPS", "1")
    assert MPSAccelerator.is_available() is False
    with pytest.raises(NoDevicesAvailableError, match="GPUs requested but none are available. This machine has no MPS"):
        MPSAccelerator().parse_devices(1)


# ---------------------------------------------------------------------------------------------------- via Fabric


def test_registry_has_the_core_accelerators():
    assert get_registry().names("accelerator") == ["cpu", "cuda", "mps"]


@pytest.mark.parametrize("name", ["cpu", "CPU", " cpu ", "auto"])
def test_fabric_resolves_cpu(name):
    if name == "auto" and (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
        pytest.skip("auto picks a GPU on this machine")
    fabric = Fabric(accelerator=name)
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.device == torch.device("cpu")


def test_fabric_accepts_an_accelerator_instance():
    accelerator = CPUAccelerator()
    assert Fabric(accelerator=accelerator).accelerator is accelerator


def test_fabric_rejects_other_accelerator_types():
    with pytest.raises(TypeError, match="`accelerator` must be a name or an Accelerator instance"):
        Fabric(accelerator=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fabric_unavailable_cuda_lists_what_is_available():
    with pytest.raises(RuntimeError, match="`CUDAAccelerator` can not run on your system.*\\['cpu'"):
        Fabric(accelerator="cuda")


def test_fabric_accelerator_from_a_missing_distribution(install_hint):
    """Plugins are off here (``core_only``): the hint says to install fabric-xla, or to load it when it is installed."""
    for name in ("tpu", "xla"):
        with pytest.raises(ValueError, match="invalid accelerator name.*" + install_hint("fabric-xla")):
            Fabric(accelerator=name)


def test_fabric_accelerator_typo():
    with pytest.raises(ValueError, match="Did you mean 'cuda'\\?"):
        Fabric(accelerator="cudaa")


@pytest.mark.parametrize("devices", [0, "0", []])
@pytest.mark.parametrize("accelerator", ["cpu", "auto", "cuda", "mps", "gpu"])
def test_fabric_refuses_no_devices_before_looking_at_the_accelerator(devices, accelerator):
    # Even where cuda/mps are not available, the error is about `devices`, naming the accelerator as given.
    with pytest.raises(ValueError, match=re.escape(f"`Fabric(devices={devices!r})` value is not a valid input using {accelerator} accelerator.")):
        Fabric(accelerator=accelerator, devices=devices)


def test_fabric_no_devices_names_an_accelerator_instance_by_class():
    with pytest.raises(ValueError, match="value is not a valid input using CPUAccelerator accelerator"):
        Fabric(accelerator=CPUAccelerator(), devices=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fabric_checks_availability_before_the_device_ids():
    # After the zero check, the accelerator must exist before its device ids are looked at.
    with pytest.raises(RuntimeError, match="`CUDAAccelerator` can not run on your system"):
        Fabric(accelerator="cuda", devices=["0"])
