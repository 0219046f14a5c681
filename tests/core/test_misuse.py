"""A catalogue of misuse: each case must fail with a typed error whose message says what is wrong and what to do.

Single-process cases live here; the multi-process ones (mismatched collectives, a rank that dies, signals,
interrupted saves) are in ``tests/plugins/ddp/test_ddp_failures.py`` and ``tests/core/test_checkpoint_faults.py``.
"""

from __future__ import annotations

import importlib.util
import pickle

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.io.checkpoint_io import CheckpointReadError, TorchCheckpointIO
from fabric_core.loggers import CSVLogger


@pytest.fixture
def fabric():
    return Fabric(accelerator="cpu", devices=1)


def _model_and_optimizer():
    model = nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


CASES = [
    # (id, callable taking the fixture's fabric, exception type, key words of the message)
    ("setup-not-a-module", lambda f: f.setup("model"), TypeError, ["expects a `torch.nn.Module`", "fabric.setup(model, optimizer)"]),
    ("setup-not-an-optimizer", lambda f: f.setup(nn.Linear(2, 1), "adam"), TypeError, ["`torch.optim.Optimizer`", "argument 1"]),
    ("setup-scheduler-as-optimizer", lambda f: f.setup(*_scheduler_as_optimizer()), TypeError, ["scheduler goes to `scheduler=`"]),
    ("setup-foreign-optimizer", lambda f: f.setup(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)), ValueError, ["updates none of the model's parameters", "model.parameters()"]),
    ("setup-module-not-a-module", lambda f: f.setup_module(42), TypeError, ["expects a `torch.nn.Module`"]),
    ("setup-optimizers-not-optimizers", lambda f: f.setup_optimizers(nn.Linear(2, 1)), TypeError, ["`torch.optim.Optimizer`"]),
    ("save-model-not-dict", lambda f: f.save("x.ckpt", nn.Linear(2, 1)), TypeError, ["expects `state` to be a dict", "{'model': model"]),
    ("load-model-not-dict", lambda f: f.load("x.ckpt", nn.Linear(2, 1)), TypeError, ["expects `state` to be a dict", "load_raw"]),
    ("save-url-unknown-scheme", lambda f: f.save("nosuchfs://bucket/x.ckpt", {"step": 1}), ValueError, ["fsspec knows no storage for 'nosuchfs://bucket/x.ckpt'"]),
    ("load-url-missing-package", lambda f: f.load("gs://bucket/x.ckpt"), ImportError, ["need gcsfs", "pip install gcsfs"]),
    ("keep-last-without-number", lambda f: f.save("last.ckpt", {"step": 1}, keep_last=2), ValueError, ["has no number in it", "step-{step}"]),
    ("keep-last-not-positive", lambda f: f.save("step-1.ckpt", {"step": 1}, keep_last=0), ValueError, ["`keep_last` must be a positive integer"]),
    ("all-reduce-bad-op", lambda f: f.all_reduce(torch.ones(1), reduce_op="average"), ValueError, ["Unsupported reduce_op 'average'", "'mean'"]),
    ("all-reduce-op-object", lambda f: f.all_reduce(torch.ones(1), reduce_op=3), ValueError, ["Unsupported reduce_op 3"]),
    ("broadcast-src", lambda f: f.broadcast(1, src=1), ValueError, ["`src` must be 0"]),
    ("launch-twice", lambda f: (f.launch(), f.launch()), RuntimeError, ["already called", "once"]),
    ("launch-not-callable", lambda f: f.launch(print("x")), TypeError, ["needs to be a callable"]),
    ("clip-both", lambda f: f.clip_gradients(nn.Linear(1, 1), None, clip_val=1, max_norm=1), ValueError, ["Only one of `clip_val` or `max_norm`"]),
]


def _scheduler_as_optimizer():
    model, optimizer = _model_and_optimizer()
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)


@pytest.mark.parametrize(("case", "call", "kind", "words"), CASES, ids=[c[0] for c in CASES])
def test_misuse_is_a_typed_error_that_says_what_to_do(fabric, tmp_path, monkeypatch, case, call, kind, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kind) as raised:
        call(fabric)
    for word in words:
        assert word in str(raised.value), f"{case}: {word!r} not in {str(raised.value)!r}"


@pytest.mark.parametrize(
    ("kwargs", "kind", "words"),
    [
        ({"strategy": "single_device", "devices": 2}, ValueError, ["runs one process on one device", "`devices` selects 2"]),
        ({"loggers": 3}, TypeError, ["`Fabric(loggers=...)` got 3", "`log_metrics`", "CSVLogger"]),
        ({"loggers": CSVLogger}, TypeError, ["pass an instance", "not the class"]),
        ({"plugins": "bf16"}, TypeError, ["invalid type for plugin"]),
        ({"num_nodes": 0}, ValueError, ["`num_nodes` must be a positive integer"]),
        pytest.param(
            {"strategy": "dpp"},
            ValueError,
            ["invalid strategy name", "Did you mean"],
            marks=pytest.mark.skipif(
                importlib.util.find_spec("fabric_ddp") is None, reason="suggests 'ddp', which needs fabric-ddp installed"
            ),
        ),
    ],
    ids=["single-device-two-devices", "logger-int", "logger-class", "plugin-str", "nodes", "typo"],
)
def test_bad_constructor_arguments(kwargs, kind, words):
    with pytest.raises(kind) as raised:
        Fabric(accelerator="cpu", **{"devices": 1, **kwargs})
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_unpicklable_function_under_spawn_explains_the_fix():
    pytest.importorskip("fabric_ddp")
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    local = lambda fabric: None  # noqa: E731 (the point: a lambda cannot be pickled)
    with pytest.raises(TypeError, match=r"cannot be pickled.*top level of a module.*DDPStrategy\(start_method='fork'\)"):
        fabric.launch(local)


# ------------------------------------------------------------------------------------------------ bad files
@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", ["the file is empty"]),
        (b"plain text, not a checkpoint\n" * 4, ["not a readable checkpoint"]),
        (None, ["not a readable checkpoint", "PytorchStreamReader"]),  # a truncated real checkpoint
    ],
    ids=["empty", "text", "truncated"],
)
def test_corrupt_empty_or_foreign_files_are_reported_as_such(tmp_path, content, words):
    path = tmp_path / "bad.ckpt"
    if content is None:
        torch.save({"w": torch.ones(1000)}, path)
        path.write_bytes(path.read_bytes()[:300])
    else:
        path.write_bytes(content)
    for mmap in (False, True):
        with pytest.raises(CheckpointReadError) as raised:
            TorchCheckpointIO().load_checkpoint(path, mmap=mmap)
        message = str(raised.value)
        assert all(w in message for w in words), message
        assert "weights_only=False" not in message  # never advice to unpickle arbitrary objects for a broken file
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(CheckpointReadError):
        fabric.load(path)


class UserObject:
    """Not allow-listed for torch's safe loader."""


def test_a_checkpoint_with_python_objects_still_gets_the_trusted_source_advice(tmp_path):
    path = tmp_path / "objects.ckpt"
    torch.save({"obj": UserObject()}, path)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        TorchCheckpointIO().load_checkpoint(path)


@pytest.mark.multiprocess
def test_spawn_without_a_main_guard_says_so(tmp_path):
    pytest.importorskip("fabric_ddp")
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from fabric_core import Fabric\n\n"
        "def work(fabric):\n    return fabric.global_rank\n\n"
        "Fabric(accelerator='cpu', strategy='ddp_spawn', devices=2).launch(work)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode != 0
    assert 'guards the main function with an `if __name__ == "__main__"` clause' in done.stderr, done.stderr[-3000:]
