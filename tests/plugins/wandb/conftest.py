"""wandb in offline mode: every run of these tests writes under the test's own folder, read back with wandb's own
tool (``wandb leet inspect``, which prints a run's ``.wandb`` transaction log as JSON)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``WANDB_MODE=offline`` and every wandb folder (runs, cache, artifact staging, config) in ``tmp_path``; the
    jobs these tests start inherit it."""
    root = tmp_path / "wandb-home"
    for variable, sub in (("WANDB_DIR", "runs"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_ARTIFACT_DIR", "artifacts")):  # fmt: skip
        (root / sub).mkdir(parents=True)
        monkeypatch.setenv(variable, str(root / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return root

