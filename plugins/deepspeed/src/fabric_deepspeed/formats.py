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
from pathlib import Path

#: The file naming the tag (sub-directory) of the newest checkpoint in the directory.
LATEST = "latest"
#: The tag our saves use (the reference's, so directories are interchangeable with it).
TAG = "checkpoint"
#: Key of our record in DeepSpeed's client state.
FORMAT_KEY = "__fabric_deepspeed__"
FORMAT_VERSION = 1
MODEL_STATES_SUFFIX = "model_states.pt"


def read_tag(path: str | os.PathLike) -> str | None:
    """The tag written in ``path/latest``, or ``None`` when there is no readable one."""
    try:
        tag = (Path(path) / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and "/" not in tag and tag not in (".", "..") else None


def model_states_files(path: str | os.PathLike, tag: str) -> list[Path]:
    """The model-states files of ``tag`` in ``path``, sorted (stage 0-2: one; stage 3: one per rank)."""
    folder = Path(path) / tag
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(folder / n for n in names if n.endswith(MODEL_STATES_SUFFIX))


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory with a ``latest`` file whose tag folder holds DeepSpeed model-states files."""
    path = Path(path)
    if not path.is_dir():
        return False
    tag = read_tag(path)
    return tag is not None and bool(model_states_files(path, tag))


def tag_folder_parent(path: str | os.PathLike) -> Path | None:
    """When ``path`` is the tag folder *inside* a DeepSpeed checkpoint, the checkpoint directory; else ``None``."""
    path = Path(path)
    parent = path.parent
    if path.is_dir() and is_deepspeed_checkpoint(parent) and read_tag(parent) == path.name:
        return parent
    return None
