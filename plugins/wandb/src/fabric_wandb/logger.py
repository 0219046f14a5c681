"""The Weights & Biases logger: one W&B run per training job, written by global rank 0 only.

This module imports ``wandb``: it is imported when the logger is first used (``Fabric(loggers="wandb")``, ``from
fabric_wandb import WandbLogger``), never while plugins are discovered, so a broken wandb installation fails that
name only (a ``PluginImportError`` naming fabric-wandb), at construction rather than at the first log call.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import wandb

from fabric_core.io import CheckpointLocation
from fabric_core.loggers import (
    CheckpointUploads,
    Logger,
    add_prefix,
    finalize_at_exit,
    params_to_dict,
    rank_zero_experiment,
)
from fabric_core.utilities import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from torch import nn

#: The x-axis of every metric: W&B's own ``step`` must only grow, but Fabric users may log a step twice or out of
#: order (a validation pass after training steps), so the step is logged as this metric instead (the name the
#: wandb SDK's own Fabric logger uses, so dashboards carry over).
STEP_METRIC = "trainer/global_step"


def _exit_code(status: str) -> int:
    if status in ("success", "finished"):
        return 0
    if status in ("failed", "killed", "interrupted"):
        return 1
    raise ValueError(f"Unknown run status {status!r}: use 'success' or 'failed'.")


def _plain(value: Any) -> Any:
    """Config values W&B can store: callables become their name, tensors their value."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)
    if type(value).__module__ == "torch" and hasattr(value, "numel"):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and type(value).__module__ in ("torch", "numpy") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


class WandbLogger(Logger):
    """Log hyperparameters, metrics and (optionally) checkpoints to a Weights & Biases run.

    Only global rank 0 starts a run and sends anything; the other ranks' calls do nothing. The run starts on the
    first log call (or the first access of :attr:`experiment`), not when the logger is created. It is finished by
    :meth:`finalize` (``fabric.teardown()``, a failing ``fabric.launch`` function) or, if nobody finalized it,
    when the process ends: marked failed (exit code 1) after an uncaught exception, finished otherwise.

    Args:
        name: the run's display name.
        save_dir: folder for W&B's local files (``<save_dir>/wandb/...``).
        version: the run id; the same as ``id`` (the reference's name for it).
        offline: write the run to ``save_dir`` only (``wandb sync`` uploads it later); same as ``WANDB_MODE=offline``.
        dir: alias of ``save_dir`` (the wandb SDK's name).
        id: the run id. A run with this id that exists already is continued (``resume="allow"``).
        anonymous: log anonymously (``anonymous="allow"`` in ``wandb.init``).
        project: the W&B project; default ``WANDB_PROJECT``, else ``"fabric_logs"``.
        prefix: put in front of every metric key, joined with ``"-"``.
        log_checkpoints: upload every checkpoint ``fabric.save`` writes as a new version of a ``model`` artifact
            (after the save is durable, off the training loop; alias ``latest``).
        checkpoint_name: the artifact's name; default ``model-<run id>``.
        resume: ``wandb.init``'s ``resume`` (``"allow"``, ``"must"``, ``"never"``); default ``"allow"`` when an id is
            given.
        experiment: an existing ``wandb`` run to log into (it is not finished by :meth:`finalize`: you own it).
        **kwargs: passed to ``wandb.init`` (``entity``, ``group``, ``tags``, ``config``, ``mode``, ``settings``, ...).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike[str] = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike[str] | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        prefix: str = "",
        log_checkpoints: bool = False,
        checkpoint_name: str | None = None,
        resume: str | bool | None = None,
        experiment: wandb.Run | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if version is not None and id is not None and version != id:
            raise ValueError(f"`version={version!r}` and `id={id!r}` name the run twice, differently: pass one.")
        run_id = version if version is not None else id
        self._save_dir = os.fspath(dir if dir is not None and os.fspath(save_dir) == "." else save_dir)
        self._project = project or os.environ.get("WANDB_PROJECT") or "fabric_logs"
        self._name = name
        self._id = run_id
        self._prefix = prefix
        self._log_checkpoints = log_checkpoints
        self._checkpoint_name = checkpoint_name
        self._init_kwargs: dict[str, Any] = {
            "name": name,
            "project": self._project,
            "dir": self._save_dir,
            "id": run_id,
            "resume": resume if resume is not None else ("allow" if run_id is not None else None),
            "anonymous": "allow" if anonymous else None,
            **({"mode": "offline"} if offline else {}),
            **kwargs,
        }
        self._experiment = experiment
        self._owns_run = experiment is None
        self._finalized = False
        self._uploads = CheckpointUploads()

    # ------------------------------------------------------------------------------------------------ the run
    @property
    @rank_zero_experiment
    def experiment(self) -> wandb.Run:
        """The ``wandb`` run (started on first access, on rank 0; other ranks get a stand-in that does nothing)."""
        if self._experiment is None:
            if wandb.run is not None:
                rank_zero_warn(
                    "A wandb run is already active in this process; `WandbLogger` logs into it (and leaves finishing"
                    " it to you). Call `wandb.finish()` first to get a run of its own."
                )
                self._experiment = wandb.run
                self._owns_run = False
            else:
                os.makedirs(self._save_dir, exist_ok=True)
                self._experiment = wandb.init(**{k: v for k, v in self._init_kwargs.items() if v is not None})
                self._owns_run = True
                self._experiment.define_metric(STEP_METRIC)
                self._experiment.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
            self._finalized = False
            finalize_at_exit(self)
        return self._experiment

    @property
    def name(self) -> str:
        """The W&B project (the run's own display name is ``experiment.name``), as in the reference's logger."""
        return self._project

    @property
    def version(self) -> str | None:
        """The run id; ``None`` until the run started unless one was given (reading it starts nothing)."""
        return self._experiment.id if self._experiment is not None else self._id

    @property
    def save_dir(self) -> str:
        """The folder W&B writes its run into (``wandb/`` below it); also ``root_dir`` and ``log_dir``."""
        return self._save_dir

    root_dir = log_dir = save_dir

    @property
    def group_separator(self) -> str:
        return self.LOGGER_JOIN_CHAR

    # ------------------------------------------------------------------------------------------------ logging
    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace | Any, *args: Any, **kwargs: Any) -> None:
        """Merge ``params`` (a dict, Namespace or dataclass; nested is fine) into the run's config."""
        self.experiment.config.update(_plain(params_to_dict(params)), allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` as one history row; ``step`` is stored as ``trainer/global_step``, the charts' x-axis."""
        row = {key: _scalar(value) for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items()}
        if step is not None:
            row[STEP_METRIC] = step
        self.experiment.log(row)

    @rank_zero_only
    def watch(self, model: nn.Module, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True) -> None:
        """Log gradients/parameters of ``model`` every ``log_freq`` steps (``wandb.Run.watch``)."""
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_saved(self, location: CheckpointLocation) -> None:
        """With ``log_checkpoints=True``, upload the checkpoint ``fabric.save`` just wrote (rank 0)."""
        if self._log_checkpoints:
            self.log_checkpoint(location)

    @rank_zero_only
    def log_checkpoint(
        self, path: str | os.PathLike[str] | CheckpointLocation, aliases: list[str] | None = None, metadata: dict | None = None
    ) -> None:
        """Upload the checkpoint at ``path`` (a file, a sharded folder, or a URL, logged as a reference) as a new
        version of the ``model`` artifact, once any save of ``path`` still in flight is durable."""
        run = self.experiment
        name = self._checkpoint_name or f"model-{run.id}"
        aliases = list(aliases) if aliases is not None else ["latest"]

        def upload(location: CheckpointLocation) -> None:
            artifact = wandb.Artifact(name=name, type="model", metadata={"path": str(location), **(metadata or {})})
            if location.is_url:
                artifact.add_reference(str(location))
            elif location.is_dir():
                artifact.add_dir(str(location.path))
            else:
                artifact.add_file(str(location.path), name=location.name)
            run.log_artifact(artifact, aliases=aliases)

        self._uploads.submit(CheckpointLocation.of(path), upload)

    # ------------------------------------------------------------------------------------------------ the end
    @rank_zero_only
    def save(self) -> None:
        """Nothing to flush: W&B sends in the background and flushes when the run finishes."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Finish the run (exit code 0 for ``"success"``, 1 for ``"failed"``) after pending checkpoint uploads.

        Idempotent; a run that never started is not started for this, and a run you passed in is left open.
        """
        exit_code = _exit_code(status)
        if self._finalized or self._experiment is None:
            return
        self._finalized = True
        self._uploads.wait()
        if self._owns_run:
            self._experiment.finish(exit_code=exit_code)

    def __getstate__(self) -> dict[str, Any]:
        """A live run cannot be pickled (spawned processes get the settings; rank 0 there starts its own run)."""
        state = self.__dict__.copy()
        state["_experiment"] = None
        state["_finalized"] = False
        return state
