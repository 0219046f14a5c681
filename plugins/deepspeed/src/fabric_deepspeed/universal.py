"""Loading a DeepSpeed checkpoint on another number of data-parallel ranks, optimizer state included.

A ZeRO checkpoint holds every rank's partition of the flat float32 groups and of the optimizer state; DeepSpeed's
engine loads it only on as many ranks as saved it (0.19.8 raises ``ZeRORuntimeException`` otherwise, its
``elastic_checkpoint`` option included, measured). DeepSpeed's own answer is its *Universal Checkpoint*:
``ds_to_universal`` rewrites the partitions as one folder per parameter (``zero/<name>/fp32.pt``, ``exp_avg.pt``,
...), and an engine with ``checkpoint.load_universal`` cuts each rank's fragment out of those full tensors, at any
data-parallel size and ZeRO stage. :func:`load_resharded` does both when ``fabric.load`` meets a checkpoint saved on
another number of ranks, so the user changes nothing:

1. on every node, its local rank 0 converts the checkpoint into a scratch folder in the node's temporary directory
   (``TMPDIR``; room for the float32 weights and the optimizer state) while the other ranks wait; a failure on any
   node fails the load on every rank, before anything was loaded;
2. every rank loads from its node's folder through the engine, with the universal switch on for this one call;
3. the universal layout carries only what the optimizer steps, so buffers and frozen parameters are loaded from the
   saved model states;
4. the scratch folders are removed once every rank has loaded.

A checkpoint converted ahead with DeepSpeed's script into a folder inside it (``python -m
deepspeed.checkpoint.ds_to_universal --input_folder ckpt/checkpoint --output_folder ckpt/checkpoint_universal
--inject_missing_state --num_extract_workers 8``: it names that folder in ``ckpt/latest_universal``) is used as it is,
without converting again: the way for checkpoints whose conversion in one process would take too long.

Internals relied on (DeepSpeed 0.19.8, pinned): ``deepspeed.checkpoint.ds_to_universal.main`` (the converter script's
entry, called with its arguments) and the engine's ``_config.load_universal_checkpoint``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from fabric_core.io import FormatContext
from fabric_core.utilities import guarded

__all__ = [
    "ReshardError",
    "check_convertible",
    "convert_to_universal",
    "converted_tag",
    "load_resharded",
    "saved_data_parallel_size",
]


class ReshardError(RuntimeError):
    """A DeepSpeed checkpoint could not be loaded on another number of data-parallel ranks."""


def saved_data_parallel_size(model_states: dict[str, Any], record: dict[str, Any] | None) -> int | None:
    """How many data-parallel ranks wrote the checkpoint: our record's, else DeepSpeed's own ``dp_world_size``."""
    if record is not None and record.get("world_size") is not None:
        return int(record["world_size"])
    size = model_states.get("dp_world_size")
    return int(size) if isinstance(size, int) else None


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _quietly() -> contextlib.ExitStack:
    """The converter prints its progress and draws tqdm bars; a load that succeeds stays quiet."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


#: The optimizer state DeepSpeed 0.19.8's converter carries over (it names these keys; another key would be dropped).
CONVERTED_STATE = frozenset({"exp_avg", "exp_avg_sq"})


def _stage_group(stage: int) -> str:
    return "3" if stage == 3 else "1-2"


def check_convertible(path: Path, tag: str, engine_stage: int, saved_size: int, world_size: int) -> None:
    """Refuse, on every rank and before anything is converted or loaded, what DeepSpeed's universal checkpoint cannot
    carry to another number of ranks: another stage family (its stage-3 layout does not load into stage 1-2 or
    back), an ``elastic_checkpoint`` (not converted), an optimizer state other than Adam's (its other keys would be
    dropped)."""
    files = sorted((p for p in (path / tag).iterdir() if p.name.endswith("optim_states.pt")), key=lambda p: _natural(p.name))
    where = f"The DeepSpeed checkpoint {str(path)!r} was saved on {saved_size} ranks and is loaded on {world_size}"
    fix = "Load it on as many ranks as saved it, or leave the optimizer out of the state to load only the weights."
    if not files:
        raise ReshardError(f"{where}, but it holds no ZeRO optimizer state files (`*optim_states.pt`). {fix}")
    optimizer = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"]
    stage = int(optimizer.get("zero_stage", 1))
    if _stage_group(stage) != _stage_group(engine_stage):
        raise ReshardError(
            f"{where} with ZeRO stage {stage} into ZeRO stage {engine_stage}: DeepSpeed's universal checkpoint, which"
            f" reshards it, keeps stage 3 and stages 1-2 apart. Load it with stage {stage}"
            f" (`strategy='deepspeed_stage_{stage}'`), or at the same stage on {saved_size} ranks. {fix}"
        )
    if stage == 3:
        groups = list(optimizer["optimizer_state_dict"]["state"].values())
    else:
        base = optimizer["base_optimizer_state"]
        if not isinstance(base, dict):
            raise ReshardError(
                f"{where}, and it was saved with ZeRO's `elastic_checkpoint: true`, which DeepSpeed 0.19.8 neither"
                " loads on another number of ranks nor converts to its universal checkpoint. Save without"
                f" `elastic_checkpoint` (the default) to resume at another size. {fix}"
            )
        groups = list(base["state"].values())
    keys = {key for group in groups for key in group if key != "step"}
    if keys != CONVERTED_STATE:
        raise ReshardError(
            f"{where}. Resharding goes through DeepSpeed's universal checkpoint, whose converter carries the state of"
            f" Adam-style optimizers ({sorted(CONVERTED_STATE)}) and nothing else; this optimizer's state holds"
            f" {sorted(keys) or 'nothing yet (saved before the first step)'}. {fix}"
        )


def convert_to_universal(path: Path, tag: str, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of ``path/tag`` into ``out/tag`` (and ``out/latest_universal``), in this
    process, one worker (a training process should not fork a pool)."""
    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(
        input_folder=str(path / tag),
        output_folder=str(out / tag),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # our saves carry no AutoTP info; DeepSpeed's default content is what it needs
    )
    with _quietly():
        main(args)


def _model_states(path: Path, tag: str) -> list[dict[str, Any]]:
    files = sorted((p for p in (path / tag).iterdir() if p.name.endswith("model_states.pt")), key=lambda p: _natural(p.name))
    return [torch.load(f, map_location="cpu", weights_only=False, mmap=True) for f in files]


def converted_tag(path: Path) -> str | None:
    """The folder inside the checkpoint that ``ds_to_universal`` wrote, when one was made ahead: DeepSpeed's script
    names it in ``latest_universal`` (``--output_folder ckpt/checkpoint_universal``); ``None`` otherwise."""
    try:
        name = (path / "latest_universal").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name or "/" in name or name in (".", "..") or not (path / name / "zero" / "optimizer_state.pt").is_file():
        return None
    return name


def _not_stepped_state(path: Path, tag: str, module: Module) -> dict[str, torch.Tensor]:
    """The saved buffers and frozen parameters of ``module`` (what the universal layout does not carry).

    Stages 0-2 store the module whole in ``mp_rank_00_model_states.pt``; stage 3 stores buffers whole in every
    rank's file and each frozen parameter as every rank's flat fragment (``frozen_param_fragments``, in rank order,
    padded at the end), which are joined here.
    """
    wanted = {name for name, p in module.named_parameters() if not p.requires_grad}
    wanted |= {name for name, _ in module.named_buffers()}
    if not wanted:
        return {}
    states = _model_states(path, tag)
    first = states[0]
    module_state = first.get("module") or {}
    out = {k: v for k, v in module_state.items() if k in wanted and torch.is_tensor(v) and v.numel() > 0}
    shapes = first.get("frozen_param_shapes") or {}
    fragments = [s.get("frozen_param_fragments") or {} for s in states]
    for name, shape in shapes.items():
        if name not in wanted or name in out or not all(name in f for f in fragments):
            continue
        flat = torch.cat([f[name].reshape(-1) for f in fragments])
        out[name] = flat[: torch.Size(shape).numel()].view(shape).clone()
    return out


def _check_names(engine: Any, model_states: dict[str, Any]) -> None:
    """Every parameter the optimizer steps needs its saved state (DeepSpeed's ``param_shapes``); say which lack it."""
    saved = {name for group in model_states.get("param_shapes") or [] for name in group}
    stepped = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    missing = sorted(stepped - saved)
    if missing:
        unexpected = sorted(saved - stepped)
        raise KeyError(
            "The DeepSpeed checkpoint does not hold the optimizer state of these parameters of the model:"
            f" {missing}" + (f" (it holds {unexpected} instead)" if unexpected else "") + ". Load a checkpoint of"
            " this model, or leave the optimizer out of the state to load the weights that match."
        )


def _load_universal(engine: Any, folder: Path, tag: str, strict: bool) -> tuple[Any, dict[str, Any]]:
    """``engine.load_checkpoint`` of the universal folder, the engine's universal switch on for this call only (and
    its logger above warnings: it warns on every rank that no model-parallel unit was given, which is right here)."""
    from deepspeed.utils import logger

    switch = engine._config
    before, level = switch.load_universal_checkpoint, logger.level
    switch.load_universal_checkpoint = True
    logger.setLevel(max(level, logging.ERROR))
    try:
        return engine.load_checkpoint(
            str(folder), tag=tag, load_module_strict=strict, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    finally:
        switch.load_universal_checkpoint = before
        logger.setLevel(level)


def _load_not_stepped(module: Module, state: dict[str, torch.Tensor]) -> None:
    """Buffers and frozen parameters into ``module``; a frozen parameter partitioned by stage 3 is gathered for it
    (every rank loads the same values; rank 0's are partitioned again)."""
    if not state:
        return
    partitioned = [p for name, p in module.named_parameters() if name in state and hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
            module.load_state_dict(state, strict=False)
    else:
        module.load_state_dict(state, strict=False)


def _convert_per_node(path: Path, tag: str, context: FormatContext) -> tuple[Path | None, Path]:
    """Convert once per node; returns (the folder this rank created, or ``None``; the folder this rank loads)."""
    topology = context.topology
    converts = topology is None or topology.local_rank == 0
    own: Path | None = None
    error: str | None = None
    if converts:
        own = Path(tempfile.mkdtemp(prefix="fabric-deepspeed-universal-"))
        _, failure = guarded(convert_to_universal, path, tag, own)  # reported on every rank below, so none waits
        if failure is not None:
            error = f"{type(failure).__name__}: {failure}"
    node = topology.node_rank if topology is not None else None
    entries = context.coordinator.all_gather_object({"node": node, "folder": str(own) if own else None, "error": error})
    failed = [(i, e["error"]) for i, e in enumerate(entries) if e["error"]]
    if failed:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        rank, message = failed[0]
        raise ReshardError(
            f"The DeepSpeed checkpoint {str(path)!r} could not be converted to DeepSpeed's universal layout, which"
            f" loading it on another number of ranks needs (rank {rank}: {message}). Load it on as many ranks as"
            " saved it, or leave the optimizer out of the state to load only the weights."
        )
    if own is not None:
        return own, own
    folder = next(e["folder"] for e in entries if e["node"] == node and e["folder"])
    return None, Path(folder)


def load_resharded(
    engine: Any,
    path: Path,
    tag: str,
    context: FormatContext,
    *,
    model_states: dict[str, Any],
    saved_size: int,
    strict: bool,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (tag ``tag``, written by ``saved_size`` data-parallel ranks; ``model_states``:
    its first model-states file) into ``engine`` on this world: model, optimizer state, step counters; returns
    DeepSpeed's client state. Collective; what cannot be resharded is refused on every rank before anything loads."""
    if engine.zero_nvme_offload_optimizer():
        raise ReshardError(
            f"The DeepSpeed checkpoint {str(path)!r} was saved on {saved_size} ranks and is loaded on"
            f" {context.world_size} with the optimizer offloaded to NVMe, which DeepSpeed's universal checkpoint does"
            " not load. Load it on as many ranks as saved it, or without NVMe offload, or leave the optimizer out of"
            " the state to load only the weights."
        )
    check_convertible(path, tag, engine.zero_optimization_stage(), saved_size, context.world_size)
    _check_names(engine, model_states)
    converted = converted_tag(path)
    if converted is not None:  # converted ahead (DeepSpeed's script, with its workers): used as it is
        created, folder, universal_tag = None, path, converted
    else:
        (created, folder), universal_tag = _convert_per_node(path, tag, context), tag

    def load() -> dict[str, Any]:
        loaded, client_state = _load_universal(engine, folder, universal_tag, strict)
        if loaded is None:
            raise ReshardError(f"DeepSpeed did not load the converted checkpoint of {str(path)!r}.")
        _load_not_stepped(engine.module, _not_stepped_state(path, tag, engine.module))
        return client_state

    # any failure of this rank must reach the vote below (raised here, the other ranks would wait at it)
    client_state, error = guarded(load)
    ok = context.coordinator.reduce_boolean_decision(error is None, all=True)
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    if error is not None:
        raise error
    if not ok:
        raise ReshardError(
            f"Loading the DeepSpeed checkpoint {str(path)!r} on {context.world_size} ranks failed on another rank;"
            " its error is in that rank's output."
        )
    return client_state or {}
