"""``fabric run --launcher ray`` on a real two-node Ray cluster (loopback, gloo on CPU): one command places one process
per device with the nodes on different Ray nodes, the script's plain ``Fabric(...)`` joins, every rank's output comes
back prefixed with its rank, the first failure ends the job with that rank's own error and exit code, and
``--max-restarts`` runs the job again; ``--ray-env`` hands the driver's variables to every rank, ``--ray-working-dir``
ships a folder to the nodes. Bad input (no cluster,
more workers than the cluster has, an unknown launcher option, a variable to forward that is not set) is refused
within seconds. The cluster's teardown (conftest) fails the module if any Ray process is left."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import session_processes, start_job
from tests.plugins.ray.conftest import HEAD_IP, SECOND_IP

SCRIPT = Path(__file__).with_name("launcher_script.py")
RUN_TIMEOUT = 300  # placing 4 actors and starting 4 interpreters with torch: 20-60 s on the 2 shared cores


def _fabric_run(cluster, tmp_path: Path, name: str, *args: str, timeout: float = RUN_TIMEOUT, env=None) -> tuple[int, str]:
    job = start_job([sys.executable, "-m", "fabric_core", "run", *args], tmp_path / f"{name}.log", env or cluster.env())
    code = job.wait(timeout)
    assert not session_processes(job.pid), "the driver left processes behind"
    return code, job.output()


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4) if (out / f"rank{r}.json").exists()]


def _out(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    return out


def _script_processes(out: Path) -> list[int]:
    """Processes still running the test script for ``out`` (a rank that outlived the job)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if str(out).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_one_command_runs_the_script_on_every_node_with_torchruns_variables(ray_cluster, tmp_path: Path) -> None:
    out = _out(tmp_path, "ok")
    # variables set only in the driver's environment (the cluster's Ray was started without them)
    driver_env = {**ray_cluster.env(), "RAYTEST_SECRET": "s3cret", "RAYTEST_P_ONE": "1", "RAYTEST_NOT_ASKED": "x"}
    code, output = _fabric_run(
        ray_cluster, tmp_path, "ok", "--launcher", "ray", "--ray-address", ray_cluster.address,
        "--ray-env", "RAYTEST_SECRET,RAYTEST_P_*,RAYTEST_GIVEN=a=b", "--num-nodes", "2", "--devices", "2",
        str(SCRIPT), str(out), "ok", env=driver_env,
    )  # fmt: skip
    assert code == 0, output[-6000:]
    records = _records(out)
    assert [r["rank"] for r in records] == [0, 1, 2, 3], output[-4000:]
    for record in records:
        assert (record["node"], record["local"], record["world"]) == (record["rank"] // 2, record["rank"] % 2, 4)
        assert record["environment"] == "TorchElasticEnvironment", "the script joins as under torchrun"
        assert record["sum"] == 6.0 and record["restart"] == 0
        assert record["weights"] == records[0]["weights"], "DDP kept the replicas equal"
        assert record["forwarded"] == {"RAYTEST_SECRET": "s3cret", "RAYTEST_P_ONE": "1", "RAYTEST_GIVEN": "a=b"}
    # nodes spread: node rank 0 on one Ray node, node rank 1 on the other
    ips = [r["node_ip"] for r in records]
    assert ips[0] == ips[1] and ips[2] == ips[3] and {ips[0], ips[2]} == {HEAD_IP, SECOND_IP}, ips
    for rank in range(4):
        assert f"[rank {rank}] hello from rank {rank} of 4, attempt 0" in output, output[-4000:]
    assert not _script_processes(out)


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_the_first_failure_ends_the_job_with_that_ranks_error_and_restarts_are_honoured(ray_cluster, tmp_path: Path) -> None:
    out = _out(tmp_path, "raise")
    code, output = _fabric_run(
        ray_cluster, tmp_path, "raise", "--launcher", "ray", "--num-nodes", "2", "--devices", "2",
        str(SCRIPT), str(out), "raise",
    )  # fmt: skip (the address from RAY_ADDRESS)
    assert code == 1, output[-6000:]
    # rank 3's own traceback, streamed with its rank (torch adds its own "[rank3]:" to a distributed job's traceback)
    assert any(line.startswith("[rank 3]") and line.endswith("ValueError: rank three cannot go on") for line in output.splitlines()), output[-6000:]
    last_words = output[output.index("[fabric] First failure:") :]
    assert last_words.startswith("[fabric] First failure: Rank 3 (node rank 1, local rank 1"), last_words
    assert "ValueError: rank three cannot go on" in last_words and "launcher_script.py" in last_words
    assert not _records(out), "no rank finished: the others were stopped"
    assert not _script_processes(out), "every rank ended with the job"

    out = _out(tmp_path, "flaky")
    code, output = _fabric_run(
        ray_cluster, tmp_path, "flaky", "--launcher", "ray", "--max-restarts", "1", "--num-nodes", "2", "--devices",
        "2", str(SCRIPT), str(out), "flaky",
    )  # fmt: skip
    assert code == 0, output[-6000:]
    assert "[fabric] restarting all 4 workers (restart 1 of 1)" in output
    assert "[rank 1] hello from rank 1 of 4, attempt 0" in output and "attempt 1" in output
    assert [r["restart"] for r in _records(out)] == [1, 1, 1, 1]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bad_input_is_refused_within_seconds(ray_cluster, tmp_path: Path) -> None:
    out = _out(tmp_path, "bad")
    script = [str(SCRIPT), str(out), "ok"]
    # nobody listens there: refused by the launcher's connect check, not after Ray's minute of retries
    code, output = _fabric_run(ray_cluster, tmp_path, "unreachable", "--launcher", "ray", "--ray-address", f"{HEAD_IP}:1", *script, timeout=30)
    assert code == 2 and f"cannot reach the Ray cluster at '{HEAD_IP}:1'" in output, output
    # 2 nodes x 3 CPUs on a cluster of 2 nodes x 2 CPUs
    code, output = _fabric_run(ray_cluster, tmp_path, "too-big", "--launcher", "ray", "--num-nodes", "2", "--devices", "3", *script, timeout=90)
    assert code == 2, output
    assert "needs 2 Ray node(s) with 3 CPU each" in output and "the cluster has 0 such node(s)" in output, output
    # 3 nodes on a 2-node cluster
    code, output = _fabric_run(ray_cluster, tmp_path, "too-many", "--launcher", "ray", "--num-nodes", "3", "--devices", "1", *script, timeout=90)
    assert code == 2 and "needs 3 Ray node(s) with 1 CPU each" in output and "has 2 such node(s)" in output, output
    code, output = _fabric_run(ray_cluster, tmp_path, "option", "--launcher", "ray", "--ray-adress", "x", *script, timeout=90)
    assert code == 2 and "unknown option(s) --ray-adress" in output and "--ray-address" in output, output
    code, output = _fabric_run(ray_cluster, tmp_path, "env", "--launcher", "ray", "--ray-env", "RAYTEST_UNSET", *script, timeout=90)
    assert code == 2 and "--ray-env names RAYTEST_UNSET, which is not set here" in output, output
    code, output = _fabric_run(ray_cluster, tmp_path, "wd", "--launcher", "ray", "--ray-working-dir", str(out), *script, timeout=90)
    assert code == 2 and "is not inside --ray-working-dir" in output and "Ray copies only that folder" in output, output
    assert not _records(out)
    # `fabric env` on this machine sees the cluster (a real head node) answer
    env = subprocess.run([sys.executable, "-m", "fabric_core", "env"], capture_output=True, text=True, timeout=60, env=ray_cluster.env())
    assert "Ray cluster:" in env.stdout and f"reachable at {ray_cluster.address} (RAY_ADDRESS)" in env.stdout, env.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_working_dir_is_copied_to_the_nodes_and_the_script_runs_from_the_copy(ray_cluster, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "jobs").mkdir(parents=True)
    shutil.copy(SCRIPT, project / "jobs" / "train.py")
    out = _out(tmp_path, "wd")
    code, output = _fabric_run(
        ray_cluster, tmp_path, "wd", "--launcher", "ray", "--ray-working-dir", str(project), "--num-nodes", "2",
        "--devices", "1", str(project / "jobs" / "train.py"), str(out), "ok",
    )  # fmt: skip
    assert code == 0, output[-6000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for record in records:
        assert record["world"] == 2 and record["sum"] == 1.0
        # Ray's copy of the folder (below its session folder), not the original, and that copy is the current folder
        assert record["script"].endswith("/jobs/train.py") and not record["script"].startswith(str(project)), record
        assert record["script"] == os.path.join(record["cwd"], "jobs", "train.py"), record
    assert {r["node_ip"] for r in records} == {HEAD_IP, SECOND_IP}


FN_SCRIPT = Path(__file__).with_name("launch_fn_script.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_fabric_launch_with_start_method_ray_runs_the_function_on_the_cluster(ray_cluster, tmp_path: Path) -> None:
    env = {**ray_cluster.env(), "RAYTEST_SECRET": "s3cret", "FABRIC_RAY_ENV": "RAYTEST_SECRET"}
    job = start_job([sys.executable, FN_SCRIPT, "ok"], tmp_path / "fn-ok.log", env)
    code, output = job.wait(RUN_TIMEOUT), job.output()
    assert code == 0, output[-6000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert result["forwarded"] == "s3cret", "FABRIC_RAY_ENV forwards the driver's variables to the actors"
    assert result["sum"] == 6.0 and result["world"] == 4, result
    assert result["ranks"] == [[0, 0, 0], [1, 1, 0], [2, 0, 1], [3, 1, 1]], "rank, local rank, node rank"
    ips = result["ips"]
    assert ips[0] == ips[1] and ips[2] == ips[3] and {ips[0], ips[2]} == {HEAD_IP, SECOND_IP}, ips
    assert result["pid"] != result["driver_pid"], "rank 0 ran in a Ray actor"
    # the actors' output reaches the driver through Ray's log forwarding, prefixed with the rank (asynchronously: a
    # rank's last lines may arrive after the job returned, so only an early line is looked for)
    assert re.search(r"\(rank [0-3] pid=\d+[^)]*\)\S* Initializing distributed: GLOBAL_RANK: [0-3]", output), output[-3000:]

    job = start_job([sys.executable, FN_SCRIPT, "raise"], tmp_path / "fn-raise.log", ray_cluster.env())
    code, output = job.wait(RUN_TIMEOUT), job.output()
    assert code == 1, output[-6000:]
    # the failing rank's own error, raised in the caller, naming the actor of rank 2
    assert "ValueError: rank two cannot go on" in output[-3000:] and "repr=rank 2)" in output, output[-6000:]
    assert "RESULT" not in output
