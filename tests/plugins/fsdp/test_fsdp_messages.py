"""fabric-fsdp's errors in the words a user of the reference recognises, with our guidance after them.

Checked in this process: each of these is raised before anything needs a process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_fsdp import FSDPPrecision, FSDPStrategy
from fabric_fsdp.checkpoint import CheckpointPathError
from fabric_fsdp.sharding import check_optimizer


def test_messages_use_the_reference_words(tmp_path: Path) -> None:
    strategy = FSDPStrategy()
    with pytest.raises(ValueError, match=r"^Could not find a FSDP model in the provided checkpoint state\. "):
        strategy.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError,
        match=r"^Gradient clipping with FSDP is only possible if the module passed to `FSDPStrategy.clip_gradients_norm` is wrapped in `FullyShardedDataParallel`.* Got: Linear\.",
    ):
        strategy.clip_gradients_norm(model, optimizer, max_norm=1.0)
    with pytest.raises(
        TypeError,
        match=r"^Blocking backward sync is only possible if the module passed to `FSDPStrategy.no_backward_sync` is wrapped in `FullyShardedDataParallel`.* Got: Linear\.",
    ):
        with strategy.backward_sync_control.no_backward_sync(model, enabled=True):
            pass
    with pytest.raises(ValueError, match=r"^The optimizer does not seem to reference any FSDP parameters\. HINT: Make sure to create the optimizer after setting up the model"):
        check_optimizer(optimizer)
    with pytest.raises(ValueError, match=r"^`precision='bf16-mixed'` does not use a scaler, found"):
        FSDPPrecision("bf16-mixed", scaler=object())
    with pytest.raises(ValueError, match=r"^`precision='64-true'` is not supported in FSDP\. .*precision='64-true'\)`"):
        FSDPPrecision("64-true")


def test_an_invalid_load_path_is_named(tmp_path: Path) -> None:
    strategy = Fabric(accelerator="cpu", strategy="fsdp", devices=2).strategy
    words = "does not point to a valid checkpoint. Make sure the path points to either a directory with FSDP checkpoint shards, or a single file with a full checkpoint."
    with pytest.raises(CheckpointPathError) as missing:
        strategy.load_checkpoint(tmp_path / "missing", {"model": nn.Linear(2, 2)})
    assert isinstance(missing.value, FileNotFoundError) and isinstance(missing.value, ValueError)  # both kinds
    assert words.replace("checkpoint.", "checkpoint: nothing exists there.", 1) in str(missing.value)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="does not point to a valid checkpoint. Make sure the path points to either a directory with FSDP checkpoint shards"):
        strategy.load_checkpoint(plain, {"model": nn.Linear(2, 2)})
