"""The bridge from Fabric to Ray Train's services: metrics to ``ray.train.report``, checkpoints to Ray's storage.

``Fabric(loggers="ray")`` inside a Ray Train worker:

* ``fabric.log``/``fabric.log_dict`` report the metrics to Ray (``ray.train.report(metrics)``) on every rank, as
  Ray Train expects every worker to report the same number of times; Ray keeps rank 0's.
* ``fabric.save(path, state)`` reports the saved checkpoint as a ``ray.train.Checkpoint`` (with the metrics logged
  last): Ray copies it into its ``RunConfig(storage_path=...)`` under the checkpoint's own name, so
  ``Result.checkpoint`` and ``Result.metrics`` hold it, and ``CheckpointConfig(num_to_keep=...)`` prunes it there.
* On a restart (``FailureConfig(max_failures=K)``), creating the logger puts Ray's latest checkpoint back at the
  path ``fabric.save`` wrote it to, when that path is missing on this node (a worker restarted on another machine,
  a fresh disk): the script's own ``fabric.latest_checkpoint(series)``/``fabric.load(...)`` then find it, unchanged.

In a Ray Tune trial (a function given to ``ray.tune.Tuner``) the same calls go to ``ray.tune.report`` /
``ray.tune.get_checkpoint``, which Ray 2.60 requires there; Tune names the checkpoint folders itself.

This module imports ``ray``: it is imported only when the name ``"ray"`` is used.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray.train

from fabric_core.io import CheckpointLocation, commit_directory, commit_file, wait_for_save
from fabric_core.loggers import Logger, add_prefix
from fabric_core.utilities import get_rank, rank_zero_warn

#: The file beside a checkpoint in Ray's storage that says where ``fabric.save`` wrote it.
METADATA = "fabric_checkpoint.json"


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and type(value).__module__ in ("torch", "numpy"):
        return value.item()
    return value


class _Session:
    """Where this process reports: Ray Train's worker API, or Ray Tune's in a Tune trial (a function trainable),
    where Ray 2.60 refuses ``ray.train.report``/``get_context``/``get_checkpoint`` and asks for ``ray.tune``'s."""

    def __init__(self, api: Any, tune: bool) -> None:
        self.api, self.tune = api, tune

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, name: str | None = None) -> None:
        if self.tune:  # Tune names the checkpoint folder itself
            self.api.report(metrics, checkpoint=checkpoint)
        else:
            self.api.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


def _session() -> _Session | None:
    try:
        ray.train.get_context().get_world_size()
        return _Session(ray.train, tune=False)
    except (RuntimeError, Warning):  # not a Train worker (in a Tune trial Ray raises a DeprecationWarning here)
        pass
    if "ray.tune" in sys.modules:  # Ray's trial runner imported it
        tune = sys.modules["ray.tune"]
        try:
            if tune.get_context().get_trial_name():
                return _Session(tune, tune=True)
        except (RuntimeError, Warning):  # not a Tune trial after all (a warning escalated by a filter too)
            pass
    return None


def _in_ray_train() -> bool:
    return _session() is not None


class RayTrainLogger(Logger):
    """Report Fabric's metrics and checkpoints to Ray Train (see the module's description).

    Args:
        prefix: put in front of every metric key, joined with ``"/"``.
        report_checkpoints: report every local checkpoint ``fabric.save`` writes to Ray (default ``True``).
        restore: on a restart, put Ray's latest checkpoint back where ``fabric.save`` wrote it, when it is missing
            there (default ``True``).
    """

    def __init__(self, prefix: str = "", report_checkpoints: bool = True, restore: bool = True) -> None:
        super().__init__()
        session = _session()
        if session is None:
            raise RuntimeError(
                "`Fabric(loggers=\"ray\")` reports to Ray Train or Ray Tune, but this process is neither a Ray Train"
                " worker nor a Tune trial. Build Fabric inside the `train_loop_per_worker` function that"
                " `ray.train.torch.TorchTrainer` runs (or the function a `ray.tune.Tuner` runs), or choose another"
                " logger here."
            )
        self._session = session
        self._prefix = prefix
        self._report_checkpoints = report_checkpoints
        self._metrics: dict[str, Any] = {}
        self.restored: str | None = None
        """Where Ray's latest checkpoint was put back when this logger was created, on each node's local rank 0 (which
        does it while the others wait); ``None`` there when there was nothing to do, and on the other ranks."""
        if restore:
            self.restored = _restore_once_per_node(session)

    @property
    def name(self) -> str | None:
        return str(self._session.api.get_context().get_experiment_name())

    @property
    def version(self) -> str | None:
        return None

    def log_hyperparams(self, params: dict[str, Any] | Namespace | None, *args: Any, **kwargs: Any) -> None:
        """Ray Train keeps a run's configuration in ``train_loop_config``; nothing is sent."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        values = {key: _scalar(value) for key, value in add_prefix(metrics, self._prefix, "/").items()}
        if step is not None:
            values["step"] = step
        self._metrics.update(values)
        self._session.report(values)

    def checkpoint_saved(self, location: CheckpointLocation) -> None:
        if not self._report_checkpoints:
            return
        if location.is_url:
            rank_zero_warn(
                f"The checkpoint {str(location)!r} is at a URL; fabric-ray reports local checkpoints to Ray only. Save to a"
                " local path (Ray copies it into `RunConfig(storage_path=...)`, which may itself be a URL)."
            )
            return
        wait_for_save(location)  # an asynchronous save is complete before Ray copies it
        source = location.path.absolute()
        # Every worker reports (Ray Train counts reports per worker); rank 0, which has the whole checkpoint (a
        # sharded one is in a folder every rank can reach), attaches it.
        with tempfile.TemporaryDirectory(prefix="fabric-ray-") as staging:
            checkpoint = None
            if get_rank() == 0:
                _link_or_copy(source, Path(staging) / source.name)
                (Path(staging) / METADATA).write_text(json.dumps({"path": str(source), "name": source.name}))
                checkpoint = self._session.api.Checkpoint.from_directory(staging)
            self._session.report(dict(self._metrics), checkpoint=checkpoint, name=source.name)

    def finalize(self, status: str) -> None:
        pass  # Ray ends the run when the training function returns


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard links where the file system allows (no bytes copied twice), copies elsewhere."""
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link_file)
    else:
        _link_file(str(source), str(target))


def _link_file(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _restore_once_per_node(session: _Session) -> str | None:
    """Local rank 0 restores, the others wait for it (Ray's process group exists before the user's function), so
    :attr:`RayTrainLogger.restored` is set on every node's local rank 0 and no two ranks copy the same files."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    restored = None
    if not grouped or session.api.get_context().get_local_rank() == 0:
        restored = restore_latest_checkpoint(session)
    if grouped:
        dist.barrier()
    return restored


def restore_latest_checkpoint(session: _Session | None = None) -> str | None:
    """Put Ray's latest checkpoint of this run back at the path ``fabric.save`` wrote it to, if it is missing there.

    Returns that path, or ``None`` when Ray has no checkpoint (a first run), the checkpoint was not written by
    fabric-ray, or the path exists already (the restarted worker is on the same machine). Safe in several processes
    at once (nodes sharing the folder): each copies beside the target and swaps its copy in whole (the copies are the
    same; the last one stays), so no reader sees a partial checkpoint.
    """
    session = session or _session()
    if session is None:
        return None
    checkpoint = session.api.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        metadata = Path(folder) / METADATA
        if not metadata.is_file():
            return None
        saved = json.loads(metadata.read_text())
        target = Path(saved["path"])
        if target.exists():
            return None
        source = Path(folder) / saved["name"]
        try:  # copied beside the target and put in place whole (the core's commits), as a save would
            if source.is_dir():
                commit_directory(target, lambda staged: shutil.copytree(source, staged.path, dirs_exist_ok=True))
            else:
                with source.open("rb") as original:
                    commit_file(target, lambda file: shutil.copyfileobj(original, file))
        except OSError:
            if not target.exists():
                raise  # no other node's copy is in place either: a real failure
    return str(target)
