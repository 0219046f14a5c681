"""Reading offline wandb runs back with wandb's own tool, ``wandb leet inspect`` (JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_files(save_dir: Path) -> list[Path]:
    """The offline runs written below ``save_dir`` (``<save_dir>/wandb/offline-run-*/run-*.wandb``)."""
    return sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb"))


def inspect_run(path: Path) -> tuple[dict, list[dict]]:
    """``(summary, records)`` of the run at ``path``, as ``wandb leet inspect`` reports them."""
    wandb_cli = [sys.executable, "-c", "import sys; from wandb.cli.cli import cli; sys.exit(cli())", "leet", "inspect"]
    summary = subprocess.run([*wandb_cli, "--summary", "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    records = subprocess.run([*wandb_cli, "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert records.returncode == 0, records.stderr
    return json.loads(summary.stdout), [json.loads(line) for line in records.stdout.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]
