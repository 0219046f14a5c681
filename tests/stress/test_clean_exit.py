"""The per-commit slice of ``make stress``: a few short successful 2-process jobs, each of which must exit 0."""

from __future__ import annotations

import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from stress_exit import run_once  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("mode", ["script", "function", "spawn", "fsdp"])
@pytest.mark.parametrize("attempt", [1, 2])
def test_a_successful_two_process_job_exits_zero(mode, attempt):
    # multiprocess-check: starts ranks (2-process jobs)
    pytest.importorskip("fabric_ddp")
    if mode == "fsdp":
        pytest.importorskip("fabric_fsdp")
    code, output = run_once(mode, timeout=180)
    assert code == 0, output[-3000:]
