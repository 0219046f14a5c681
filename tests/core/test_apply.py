from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from unittest import mock

import numpy as np
import pytest
import torch

from fabric_core.utilities.apply import (
    apply_to_collection,
    convert_tensors_to_scalars,
    convert_to_tensors,
    move_data_to_device,
)

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    label: str
    extra: list
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.post_init_calls = getattr(self, "post_init_calls", 0) + 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_apply_rebuilds_nested_containers_with_their_types():
    data = {
        "list": [torch.tensor(1), "text"],
        "tuple": (torch.tensor(2), 3),
        "point": Point(torch.tensor(4), None),
        "ordered": OrderedDict([("b", torch.tensor(5)), ("a", torch.tensor(6))]),
        "set": {7},
    }
    out = apply_to_collection(data, torch.Tensor, double)

    assert out["list"][0].item() == 2 and out["list"][1] == "text"
    assert isinstance(out["tuple"], tuple) and out["tuple"][0].item() == 4 and out["tuple"][1] == 3
    assert type(out["point"]) is Point and out["point"].x.item() == 8 and out["point"].y is None
    assert type(out["ordered"]) is OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert out["ordered"]["a"].item() == 12
    assert out["set"] == {7}
    # the input is untouched
    assert data["list"][0].item() == 1 and data["point"].x.item() == 4


def test_apply_keeps_defaultdict_factory():
    data = defaultdict(list, {"a": torch.tensor(1)})
    out = apply_to_collection(data, torch.Tensor, double)
    assert type(out) is defaultdict
    assert out["a"].item() == 2
    assert out["missing"] == []


def test_apply_passes_extra_arguments():
    out = apply_to_collection([torch.tensor(1.0)], torch.Tensor, torch.add, 10, alpha=2)
    assert out[0].item() == 21.0


def test_apply_to_dataclass_does_not_rerun_init_and_keeps_init_false_fields():
    batch = Batch(torch.tensor([1, 2]), "a", [torch.tensor(3)])
    batch.derived = 9
    out = apply_to_collection(batch, torch.Tensor, double)

    assert type(out) is Batch and out is not batch
    assert out.inputs.tolist() == [2, 4]
    assert out.extra[0].item() == 6
    assert out.label == "a"
    assert out.derived == 9
    assert out.post_init_calls == 1
    assert batch.inputs.tolist() == [1, 2]


def test_apply_to_frozen_dataclass():
    out = apply_to_collection(Frozen(torch.tensor(1)), torch.Tensor, double)
    assert out.value.item() == 2


def test_apply_leaves_dataclass_types_and_unknown_objects_alone():
    marker = object()
    assert apply_to_collection(Batch, torch.Tensor, double) is Batch
    assert apply_to_collection(marker, torch.Tensor, double) is marker
    assert apply_to_collection("abc", str, str.upper) == "ABC"


def test_move_data_to_device_moves_nested_tensors_and_modules():
    module = torch.nn.Linear(2, 2).double()
    batch = {"x": [torch.ones(2)], "m": module, "name": "n"}
    out = move_data_to_device(batch, "cpu")
    assert out["x"][0].device == torch.device("cpu")
    assert out["m"] is module
    assert out["name"] == "n"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", {}),
        ("mps", {}),
        ("cuda:0", {"non_blocking": True}),
        (torch.device("cuda", 1), {"non_blocking": True}),
    ],
)
def test_move_data_to_device_non_blocking_only_for_accelerators(device, expected):
    tensor = torch.ones(1)
    # A plain mock (not a descriptor) is not bound, so it records the arguments after ``self``.
    with mock.patch.object(torch.Tensor, "to", return_value=tensor) as to:
        move_data_to_device([tensor], device)
    (call,) = to.call_args_list
    assert call.args == (torch.device(device),)
    assert call.kwargs == expected


def test_move_data_to_device_non_tensor_to_gets_no_non_blocking():
    class Custom:
        def __init__(self) -> None:
            self.calls = []

        def to(self, *args, **kwargs):
            self.calls.append((args, kwargs))
            return self

    obj = Custom()
    assert move_data_to_device({"c": obj}, "cuda")["c"] is obj
    assert obj.calls == [((torch.device("cuda"),), {})]


def test_move_data_to_device_keeps_object_when_custom_to_returns_none():
    class InPlace:
        device = None

        def to(self, device):
            self.device = device  # moves in place, returns nothing

    obj = InPlace()
    out = move_data_to_device([obj], "cpu")
    assert out[0] is obj
    assert obj.device == torch.device("cpu")


def test_convert_to_tensors_dtypes():
    out = convert_to_tensors({"b": True, "i": 3, "f": 0.5, "arr": np.arange(3), "s": "text"}, "cpu")
    assert out["b"].dtype == torch.uint8 and out["b"].item() == 1
    assert out["i"].dtype == torch.int32 and out["i"].item() == 3
    assert out["f"].dtype == torch.float32 and out["f"].item() == 0.5
    assert torch.equal(out["arr"], torch.arange(3))
    assert out["s"] == "text"


def test_convert_to_tensors_copies_numpy_and_moves_tensors():
    array = np.zeros(2)
    out = convert_to_tensors([array, torch.ones(1)], torch.device("cpu"))
    out[0] += 1
    assert array.tolist() == [0.0, 0.0]
    assert out[1].device == torch.device("cpu")


def test_convert_tensors_to_scalars():
    data = {"a": torch.tensor(1.5), "b": [torch.tensor([[2]])], "c": "keep"}
    out = convert_tensors_to_scalars(data)
    assert out == {"a": 1.5, "b": [2], "c": "keep"}
    assert isinstance(data["a"], torch.Tensor) and isinstance(data["b"][0], torch.Tensor)


def test_convert_tensors_to_scalars_rejects_multi_element_tensors():
    with pytest.raises(
        ValueError, match=r"The metric `tensor\(\[3, 4\]\)` does not contain a single element"
    ):
        convert_tensors_to_scalars({"x": torch.tensor([3, 4])})
