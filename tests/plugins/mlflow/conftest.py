"""A real MLflow tracking server on loopback for this folder's tests: one per test process (xdist worker)."""

from __future__ import annotations

import mlflow_server  # beside this file (pytest puts a conftest's folder on sys.path)
import pytest


@pytest.fixture(scope="session")
def mlflow_server_uri(tmp_path_factory: pytest.TempPathFactory):
    server = mlflow_server.start(tmp_path_factory.mktemp("mlflow-server"))
    yield server.uri
    server.stop()


@pytest.fixture
def tracking_uri(mlflow_server_uri: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The server's URI, also in ``MLFLOW_TRACKING_URI`` for this test (and the jobs it starts)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server_uri)
    return mlflow_server_uri
