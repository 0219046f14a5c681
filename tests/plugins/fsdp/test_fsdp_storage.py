"""FSDP checkpoints through an S3-compatible server on loopback, and asynchronous sharded saves (2 real ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import run_ranks

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3_server

    server, endpoint = s3_server.start()
    s3_server.create_bucket(endpoint, "ckpts")
    try:
        yield endpoint
    finally:
        server.stop()


def test_fsdp_checkpoints_round_trip_through_s3_and_async_saves_snapshot(tmp_path, s3, monkeypatch):
    import s3_server

    for key, value in s3_server.client_env(s3).items():
        monkeypatch.setenv(key, value)  # the ranks inherit the server's address
    run_ranks(SCRIPTS / "storage_checks.py", str(tmp_path), "s3://ckpts/run1", tmp_path=tmp_path, timeout=240)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sharded_continues"] and result["second_save_wins"] and result["full_round_trip"], result
    versions = [v for v in result["versions_left"] if v.startswith("v-")]
    assert len(versions) == 1 and ".fabric-committed" in result["versions_left"], result
    assert result["async_snapshot"] and result["async_no_temp"], result
    assert result["async_remote_snapshot"], result  # the values from the call, not from after it
    left = result["async_remote_left"]
    assert len([v for v in left if v.startswith("v-")]) == 1 and ".fabric-committed" in left, result
