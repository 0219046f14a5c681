"""The on-disk layout of a DeepSpeed checkpoint, recognisable without importing torch or deepspeed.

``fabric.save("ckpt", state)`` with a DeepSpeed strategy writes DeepSpeed's own checkpoint directory (its engine
writes it; we commit it crash-safely)::

    ckpt/
      latest                                     the tag of the checkpoint inside: "checkpoint"
      zero_to_fp32.py, zero_to_torch.py          DeepSpeed's recovery scripts (ZeRO stages 1-3)
      checkpoint/
        mp_rank_00_model_states.pt               stages 0-2: the module, written by rank 0
        zero_pp_rank_R_mp_rank_00_model_states.pt stage 3: every rank's share of the module
        [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   every rank's partition of the optimizer (ZeRO)

Everything of the user's state that is not the engine (step, epoch, schedulers, dataloaders, other modules) is
DeepSpeed's *client state*, stored inside the model-states files under one key of ours, :data:`FORMAT_KEY`
(so nothing collides with DeepSpeed's own keys). A directory written by a plain DeepSpeed script has the same
layout without that record; it is read as well (the model then sits under ``"model"``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabric_core.io import CheckpointLocation

#: The file naming the tag (sub-directory) of the newest checkpoint in the directory.
LATEST = "latest"
#: The tag our saves use (the reference's, so directories are interchangeable with it).
TAG = "checkpoint"
#: Key of our record in DeepSpeed's client state.
FORMAT_KEY = "__fabric_deepspeed__"
FORMAT_VERSION = 1
MODEL_STATES_SUFFIX = "model_states.pt"


def read_tag(path: CheckpointLocation | str | os.PathLike) -> str | None:
    """The tag written in ``path/latest``, or ``None`` when there is no readable one."""
    from fabric_core.io import CheckpointLocation

    try:
        with CheckpointLocation.of(path).child(LATEST).open("rb") as file:
            tag = file.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and "/" not in tag and tag not in (".", "..") else None


def model_states_files(path: CheckpointLocation | str | os.PathLike, tag: str) -> list[CheckpointLocation]:
    """The model-states files of ``tag`` in ``path``, sorted (stage 0-2: one; stage 3: one per rank)."""
    from fabric_core.io import CheckpointLocation

    folder = CheckpointLocation.of(path).child(tag)
    return [folder.child(n) for n in folder.listdir() if n.endswith(MODEL_STATES_SUFFIX)]


def is_deepspeed_checkpoint(path: CheckpointLocation | str | os.PathLike) -> bool:
    """True for a folder (local, or the committed version at a URL) with a ``latest`` file whose tag folder holds
    model-states files."""
    from fabric_core.io import CheckpointLocation

    location = CheckpointLocation.of(path).committed()
    if not location.is_dir():
        return False
    tag = read_tag(location)
    return tag is not None and bool(model_states_files(location, tag))


def tag_folder_parent(path: CheckpointLocation | str | os.PathLike) -> CheckpointLocation | None:
    """When ``path`` is the tag folder *inside* a DeepSpeed checkpoint, the checkpoint folder; else ``None``."""
    from fabric_core.io import CheckpointLocation

    location = CheckpointLocation.of(path)
    parent = location.parent
    if location.is_dir() and is_deepspeed_checkpoint(parent) and read_tag(parent) == location.name:
        return parent
    return None
