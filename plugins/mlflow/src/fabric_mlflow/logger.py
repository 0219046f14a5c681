"""The MLflow logger: one MLflow run per training job, written by global rank 0 only, through ``MlflowClient``.

The client API is used rather than MLflow's fluent ``mlflow.start_run()``: the fluent API keeps one active run
per process in a global, which would tie the logger to whatever else the script does with MLflow.

This module imports the MLflow client: it is imported when the logger is first used (``Fabric(loggers="mlflow")``,
``from fabric_mlflow import MLFlowLogger``), never while plugins are discovered, so a broken MLflow installation
fails that name only (a ``PluginImportError`` naming fabric-mlflow), at construction rather than at the first log.
"""

from __future__ import annotations

import os
import re
import time
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from fabric_core.io import CheckpointLocation
from fabric_core.loggers import (
    CheckpointUploads,
    Logger,
    add_prefix,
    finalize_at_exit,
    flatten_params,
    params_to_dict,
    rank_zero_experiment,
)
from fabric_core.utilities import rank_zero_only, rank_zero_warn

# MLflow's limits per log_batch call and per parameter value (mlflow.utils.validation).
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE_LENGTH = 6000
_INVALID_KEY_CHARS = re.compile(r"[^\w\-. /:]")  # what MLflow accepts in metric and param names

_STATUSES = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "killed": "KILLED", "interrupted": "KILLED"}


def _run_status(status: str) -> str:
    try:
        return _STATUSES[status]
    except KeyError:
        raise ValueError(f"Unknown run status {status!r}: use one of {', '.join(_STATUSES)}.") from None


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class MLFlowLogger(Logger):
    """Log parameters, metrics, tags and (optionally) checkpoints to an MLflow run.

    Only global rank 0 creates the run and sends anything; the other ranks' calls do nothing. The experiment and the
    run are created on the first log call (or the first access of :attr:`run_id`), not when the logger is created.
    The run is ended by :meth:`finalize` (``fabric.teardown()``, a failing ``fabric.launch`` function) or, if nobody
    finalized it, when the process ends: ``FAILED`` after an uncaught exception, ``FINISHED`` otherwise.

    Args:
        experiment_name: the MLflow experiment, created if it does not exist.
        run_name: the run's name (MLflow picks one when ``None``).
        tracking_uri: where the tracking server (or store) is; default ``MLFLOW_TRACKING_URI``, else MLflow's own
            default (a local ``sqlite:///mlflow.db``, which needs the full ``mlflow`` package).
        tags: tags set on the run.
        prefix: put in front of every metric key, joined with ``"-"``.
        artifact_location: where a newly created experiment stores artifacts (the server's default otherwise).
        run_id: continue this existing run instead of creating one (resuming a job).
        log_checkpoints: upload every checkpoint ``fabric.save`` writes as run artifacts under
            ``checkpoints/`` (after the save is durable, off the training loop).
        synchronous: ``False`` queues metric batches in MLflow's background logger instead of waiting for the
            server on every call (flushed by :meth:`save` and :meth:`finalize`).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "fabric_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        log_checkpoints: bool = False,
        synchronous: bool = True,
    ) -> None:
        super().__init__()
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._log_checkpoints = log_checkpoints
        self._synchronous = synchronous
        self._client: MlflowClient | None = None
        self._pending: list[Any] = []  # RunOperations of asynchronous batches
        self._finalized = False
        self._warned_keys: set[str] = set()
        self._uploads = CheckpointUploads()

    # ------------------------------------------------------------------------------------------------ the run
    @property
    @rank_zero_experiment
    def experiment(self) -> MlflowClient:
        """The ``MlflowClient`` (rank 0; other ranks get a stand-in that does nothing). The run exists once this returns."""
        if self._client is None:
            try:
                client = MlflowClient(tracking_uri=self._tracking_uri)
                self._open_run(client)
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(
                    f"MLflow cannot open its tracking store ({err}). Point the logger at a tracking server with"
                    " `MLFlowLogger(tracking_uri='http://host:5000')` or `MLFLOW_TRACKING_URI`, or install the full"
                    " `mlflow` package for a local store."
                ) from err
            self._client = client
            self._finalized = False
            finalize_at_exit(self)
        return self._client

    def _open_run(self, client: MlflowClient) -> None:
        if self._run_id is not None:
            run = client.get_run(self._run_id)  # raises when it does not exist: resuming needs the real run
            self._experiment_id = run.info.experiment_id
            if run.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
            for key, value in self._tags.items():
                client.set_tag(self._run_id, key, value)
            return
        experiment = client.get_experiment_by_name(self._experiment_name)
        if experiment is None:
            self._experiment_id = client.create_experiment(self._experiment_name, artifact_location=self._artifact_location)
        else:
            self._experiment_id = experiment.experiment_id
        tags = dict(self._tags)
        run = client.create_run(self._experiment_id, run_name=self._run_name, tags=tags)
        self._run_id = run.info.run_id

    @property
    def run_id(self) -> str | None:
        """The run's id (creates the run on rank 0; ``None`` on other ranks unless one was given)."""
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> str:
        """The experiment's name."""
        return self._experiment_name

    @property
    def version(self) -> str | None:
        """The run id; ``None`` until the run exists unless one was given (reading it creates nothing)."""
        return self._run_id

    # ------------------------------------------------------------------------------------------------ logging
    def _key(self, key: str) -> str:
        clean = _INVALID_KEY_CHARS.sub("_", key)
        if clean != key and key not in self._warned_keys:
            self._warned_keys.add(key)
            rank_zero_warn(f"MLflow does not accept the name {key!r}; it is logged as {clean!r}.")
        return clean

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace | Any, *args: Any, **kwargs: Any) -> None:
        """Log ``params`` (nested configs become ``a/b`` names) as run parameters.

        MLflow keeps a parameter's first value: logging the same name again with another value is an error there.
        Values longer than MLflow's limit (6000 characters) are cut, with a warning.
        """
        items = []
        for key, value in flatten_params(params_to_dict(params)).items():
            text = str(value)
            if len(text) > _MAX_PARAM_VALUE_LENGTH:
                rank_zero_warn(f"The parameter {key!r} is longer than MLflow accepts; its value is cut to {_MAX_PARAM_VALUE_LENGTH} characters.")
                text = text[:_MAX_PARAM_VALUE_LENGTH]
            items.append(Param(self._key(key), text))
        client = self.experiment
        for chunk in _chunks(items, _MAX_PARAMS_PER_BATCH):
            client.log_batch(self._run_id, params=chunk)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log numbers at ``step`` (0 when not given, as MLflow needs one); strings are skipped with a warning."""
        timestamp = int(time.time() * 1000)
        items = []
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, str) or not isinstance(value, (int, float)):
                rank_zero_warn(f"MLflow logs numbers only: the metric {key!r} = {value!r} is skipped.")
                continue
            items.append(Metric(self._key(key), float(value), timestamp, int(step or 0)))
        client = self.experiment
        for chunk in _chunks(items, _MAX_METRICS_PER_BATCH):
            if self._synchronous:
                client.log_batch(self._run_id, metrics=chunk)
            else:
                self._pending.append(client.log_batch(self._run_id, metrics=chunk, synchronous=False))

    @rank_zero_only
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) tags of the run."""
        client = self.experiment
        items = [RunTag(str(key), str(value)) for key, value in tags.items()]
        for chunk in _chunks(items, _MAX_PARAMS_PER_BATCH):
            client.log_batch(self._run_id, tags=chunk)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_saved(self, location: CheckpointLocation) -> None:
        """With ``log_checkpoints=True``, upload the checkpoint ``fabric.save`` just wrote (rank 0)."""
        if self._log_checkpoints:
            self.log_checkpoint(location)

    @rank_zero_only
    def log_checkpoint(self, path: str | os.PathLike[str] | CheckpointLocation, artifact_path: str = "checkpoints") -> None:
        """Upload the checkpoint at ``path`` (a file or a sharded folder) to ``<artifact_path>/<its name>`` of the
        run, once any save of ``path`` still in flight is durable. A URL is recorded as the tag
        ``fabric.checkpoint`` instead (MLflow cannot copy from remote storage)."""
        client, run_id = self.experiment, self._run_id
        location = CheckpointLocation.of(path)
        if location.is_url:
            client.set_tag(run_id, "fabric.checkpoint", str(location))
            return

        def upload(saved: CheckpointLocation) -> None:
            if saved.is_dir():
                client.log_artifacts(run_id, str(saved.path), artifact_path=f"{artifact_path}/{saved.path.name}")
            else:
                client.log_artifact(run_id, str(saved.path), artifact_path=artifact_path)

        self._uploads.submit(location, upload)

    # ------------------------------------------------------------------------------------------------ the end
    @rank_zero_only
    def save(self) -> None:
        """Wait until queued (``synchronous=False``) batches reached the server."""
        pending, self._pending = self._pending, []
        for operations in pending:
            operations.wait()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """End the run: ``FINISHED`` for ``"success"``, ``FAILED`` for ``"failed"``, ``KILLED`` for ``"killed"``.

        Waits for queued batches and checkpoint uploads first. Idempotent; a run that never started is not
        created for this.
        """
        mlflow_status = _run_status(status)
        if self._finalized or self._client is None:
            return
        self._finalized = True
        try:
            self.save()
            self._uploads.wait()
        finally:
            self._client.set_terminated(self._run_id, status=mlflow_status)

    def __getstate__(self) -> dict[str, Any]:
        """The client is recreated after unpickling (spawned processes); the run id, if any, travels along."""
        state = self.__dict__.copy()
        state["_client"] = None
        state["_pending"] = []
        state["_finalized"] = False
        return state
