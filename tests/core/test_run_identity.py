"""The run identity (fabric_core/runtime/run.py): one id on every rank and in every attempt, the attempt number,
and the run folder, through the ways users start jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fabric_core import Fabric
from fabric_core.runtime import run
from tests.jobs import fabric_command, job_env, run_job, start_job

SCRIPT = Path(__file__).parent / "scripts" / "run_identity_job.py"


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("attempt*-rank*.json"))]


def test_run_info_in_one_process(tmp_path, monkeypatch):
    for name in (run.RUN_ID_VARIABLE, run.RUN_DIR_VARIABLE, run.JOB_ID_VARIABLE, *run.RESTART_COUNTS, *run.SCHEDULER_JOB_IDS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    fabric = Fabric(accelerator="cpu", loggers={"csv": {"root_dir": str(tmp_path / "logs")}})
    info = fabric.run_info
    assert info is fabric.run_info  # resolved once
    assert info.attempt == 0 and info.restart == 0 and not info.chosen
    assert info.id == info.job == run.job_id()
    assert info.dir == tmp_path / "logs" / "runs" / info.id  # beside the loggers' output
    assert not info.dir.exists()  # nothing written yet: no folder
    info.path("goodput", "x.json").write_text("{}")
    record = run.read_record(info.dir)
    assert record["run_id"] == info.id and [a["attempt"] for a in record["attempts"]] == [0]
    assert record["attempts"][0]["world_size"] == 1

    # A folder chosen by argument wins over FABRIC_RUN_DIR, and without loggers the default root is fabric_logs.
    monkeypatch.setenv(run.RUN_DIR_VARIABLE, str(tmp_path / "by-env"))
    assert Fabric(accelerator="cpu", run_dir=tmp_path / "by-arg").run_info.dir == tmp_path / "by-arg"
    assert Fabric(accelerator="cpu").run_info.dir == tmp_path / "by-env"
    monkeypatch.delenv(run.RUN_DIR_VARIABLE)
    assert Fabric(accelerator="cpu").run_info.dir == Path("fabric_logs") / "runs" / info.id

    with pytest.raises(TypeError, match="must be a path"):
        Fabric(accelerator="cpu", run_dir=3)


def test_a_resubmitted_job_continues_the_run_and_counts_attempts(tmp_path, monkeypatch):
    for name in (run.RUN_ID_VARIABLE, run.RUN_DIR_VARIABLE, *run.RESTART_COUNTS, *run.SCHEDULER_JOB_IDS):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "run"
    monkeypatch.setenv(run.JOB_ID_VARIABLE, "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = Fabric(accelerator="cpu", run_dir=folder).run_info
    first.path("x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted job-a once
    again = Fabric(accelerator="cpu", run_dir=folder).run_info
    again.path("x")
    assert (again.id, again.attempt, again.restart) == ("job-a", 1, 1)

    monkeypatch.setenv(run.JOB_ID_VARIABLE, "job-b")  # a new job into the same folder: the same run, attempt 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    later = Fabric(accelerator="cpu", run_dir=folder).run_info
    assert (later.id, later.attempt, later.job, later.chosen) == ("job-a", 2, "job-b", True)
    later.path("x")
    assert [(a["job"], a["attempt"]) for a in run.read_record(folder)["attempts"]] == [("job-a", 0), ("job-a", 1), ("job-b", 2)]

    monkeypatch.setenv(run.RUN_ID_VARIABLE, "another")
    with pytest.raises(ValueError, match="belongs to run 'job-a'"):
        _ = Fabric(accelerator="cpu", run_dir=folder).run_info
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    monkeypatch.delenv(run.RUN_ID_VARIABLE)
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT=x"):
        _ = Fabric(accelerator="cpu", run_dir=folder).run_info


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["launch", "spawn"])
def test_every_rank_of_a_launched_job_has_one_run(tmp_path, mode):
    pytest.importorskip("fabric_ddp", reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    out = tmp_path / "out"
    out.mkdir()
    job = start_job([sys.executable, SCRIPT, out, mode], tmp_path / "job.log", env=job_env(PYTHONWARNINGS="ignore"), cwd=tmp_path)
    assert job.wait(180) == 0, job.output()[-3000:]
    assert not job.leftovers()
    ranks = _records(out)
    assert [r["global_rank"] for r in ranks] == [0, 1]
    assert len({(r["id"], r["dir"], r["job"], r["attempt"]) for r in ranks}) == 1, ranks
    folder = Path(ranks[0]["dir"])
    if mode == "launch":
        assert folder == out / "logs" / "runs" / ranks[0]["id"]
    record = run.read_record(folder if folder.is_absolute() else tmp_path / folder)
    assert record is not None and len(record["attempts"]) == 1 and record["attempts"][0]["world_size"] == 2


@pytest.mark.multiprocess
def test_fabric_run_restarts_keep_the_run_and_count_attempts(tmp_path):
    pytest.importorskip("fabric_ddp", reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    out = tmp_path / "out"
    out.mkdir()
    command = [*fabric_command(), "--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--max-restarts", "1", SCRIPT, out, "cli", "fail"]
    env = job_env(PYTHONWARNINGS="ignore", FABRIC_RUN_DIR=str(tmp_path / "run"))
    _, code = run_job(command, tmp_path / "job.log", timeout=240, env=env)
    assert code == 0, (tmp_path / "job.log").read_text()[-3000:]
    ranks = _records(out)
    assert sorted((r["attempt"], r["global_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({(r["id"], r["dir"], r["job"]) for r in ranks}) == 1, ranks
    assert {r["restart"] for r in ranks} == {0, 1}
    record = run.read_record(tmp_path / "run")
    assert [a["attempt"] for a in record["attempts"]] == [0, 1] and record["run_id"] == ranks[0]["id"]


def test_a_multi_node_fabric_run_derives_its_job_id_from_the_rendezvous(monkeypatch):
    for name in run.SCHEDULER_JOB_IDS:
        monkeypatch.delenv(name, raising=False)
    one = run.job_environment(new=True, rendezvous="10.0.0.1:29400/")
    assert one == run.job_environment(new=True, rendezvous="10.0.0.1:29400/")  # every node computes the same
    assert run.job_environment(new=True) != run.job_environment(new=True)  # one node: a fresh id per job
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run.job_environment(new=True, rendezvous="10.0.0.1:29400/") == {run.JOB_ID_VARIABLE: "4242"}
