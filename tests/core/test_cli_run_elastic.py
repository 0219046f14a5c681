"""``fabric run``'s torchrun options (restarts, rendezvous, logging): parsing and the torchrun line they become.

The jobs that restart for real are in tests/plugins/ddp/test_elastic_restarts.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
from torch.distributed.run import get_args_parser

from fabric_core import cli_run
from fabric_core.cli import main


def _torchrun(argv: list[str], nprocs: int = 2) -> list[str]:
    return cli_run.torchrun_arguments(cli_run.parse_run_args(argv), nprocs)


def _parsed_by_torchrun(line: list[str]):
    """What torchrun's own parser makes of the line we give it (so a wrong flag name fails here, not in a job)."""
    return get_args_parser().parse_args(line)


def test_the_references_flags_become_a_static_rendezvous():
    line = _torchrun(["--num_nodes", "2", "--node_rank", "1", "--main_address", "10.0.0.1", "--main_port", "1234", "train.py", "--lr", "1"])
    parsed = _parsed_by_torchrun(line)
    assert (parsed.nnodes, parsed.node_rank, parsed.master_addr, parsed.master_port) == ("2", 1, "10.0.0.1", 1234)
    assert parsed.rdzv_backend == "static" and parsed.max_restarts == 0 and parsed.monitor_interval == 0.1
    assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--lr", "1"])


@pytest.mark.parametrize("spelling", ["dash", "underscore"])
def test_restart_and_logging_options_are_passed_on(spelling: str, tmp_path: Path):
    def flag(name: str) -> str:
        return name if spelling == "dash" else name.replace("-", "_").replace("__", "--", 1)

    argv = [
        flag("--max-restarts"), "3", flag("--monitor-interval"), "0.5", flag("--log-dir"), str(tmp_path), "--tee", "3",
        flag("--local-ranks-filter"), "0", flag("--rdzv-conf"), "join_timeout=60", "--devices", "2", "train.py",
    ]  # fmt: skip
    parsed = _parsed_by_torchrun(_torchrun(argv))
    assert parsed.max_restarts == 3 and parsed.monitor_interval == 0.5
    assert parsed.log_dir == str(tmp_path) and parsed.tee == "3" and parsed.local_ranks_filter == "0"
    assert parsed.rdzv_conf == "join_timeout=60" and parsed.nproc_per_node == "2"


def test_c10d_meets_at_the_main_address_unless_an_endpoint_is_given():
    parsed = _parsed_by_torchrun(_torchrun(["--rdzv-backend", "c10d", "--main-port", "4321", "--rdzv-id", "job7", "train.py"]))
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == ("c10d", "127.0.0.1:4321", "job7")
    parsed = _parsed_by_torchrun(_torchrun(["--rdzv_backend=c10d", "--rdzv_endpoint=node0:29999", "train.py"]))
    assert parsed.rdzv_endpoint == "node0:29999"


def test_standalone_leaves_the_rendezvous_to_torchrun():
    line = _torchrun(["--standalone", "-r", "0:3", "train.py"])
    parsed = _parsed_by_torchrun(line)
    assert parsed.standalone and parsed.redirects == "0:3"
    assert not any(item.startswith(("--master-port", "--master-addr", "--node-rank")) for item in line)


def test_torchrun_options_after_the_script_belong_to_the_script():
    """Many scripts have their own --log-dir or -t: only Fabric's own (the reference's) options count after SCRIPT."""
    args = cli_run.parse_run_args(["--max-restarts", "1", "train.py", "--log-dir", "runs", "-t", "x", "--max-restarts", "9", "--devices", "2"])
    assert args.max_restarts == 1 and args.log_dir is None and args.tee is None and args.devices == "2"
    assert args.script_args == ["--log-dir", "runs", "-t", "x", "--max-restarts", "9"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--max-restarts", "two"], "invalid int value 'two'"),
        (["--monitor-interval", "0"], "--monitor-interval must be a positive number"),
        (["--tee", "7"], "--tee takes 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--redirects", "all"], "--redirects takes 0 (none)"),
        (["--rdzv-backend", "zookeeper"], "--rdzv-backend must be one of static, c10d, etcd, etcd-v2"),
        (["--standalone", "--num-nodes", "2"], "--standalone runs the rendezvous on this node alone"),
        (["--standalone", "--rdzv-backend", "c10d"], "--standalone chooses the rendezvous itself"),
        (["--rdzv-endpoint", "host:1"], "--rdzv-endpoint is for the c10d/etcd backends"),
        (["--standalone=1"], "option --standalone takes no value"),
        (["--num-nodes", "1:2", "--rdzv-backend", "static"], "--num-nodes 1:2 lets nodes leave and join"),
        (["--num-nodes", "1:2", "--standalone"], "needs an elastic rendezvous"),
        (["--num-nodes", "3:2"], "'3:2' is not a number of nodes N or a range MIN:MAX"),
        (["--num-nodes", "1:2", "--node-rank", "2"], "--node-rank must be between 0 and 1"),
    ],
)
def test_bad_torchrun_options_are_usage_errors(argv: list[str], words: str, tmp_path: Path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["run", *argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert "Usage: fabric run" in err and words in err, err


def test_help_lists_the_torchrun_options(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "torchrun's restart, rendezvous and logging options (before SCRIPT" in out
    for flag in ("--max-restarts", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--standalone", "--monitor-interval", "--tee", "--log-dir"):
        assert flag in out


def test_a_range_of_nodes_is_an_elastic_job_on_a_c10d_rendezvous():
    """`--num-nodes MIN:MAX` (issue 38): torchrun gets the range and a c10d rendezvous at the main address (unless
    another elastic backend is given); every worker's Fabric gets the range, and takes its attempt's count."""
    args = cli_run.parse_run_args(["--num-nodes", "1:2", "--main-port", "4321", "--max-restarts", "3", "train.py"])
    parsed = _parsed_by_torchrun(cli_run.torchrun_arguments(args, 1))
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.max_restarts) == ("1:2", "c10d", "127.0.0.1:4321", 3)
    with mock.patch.dict(os.environ):  # prepare_environment exports into this process: keep it out of later tests
        assert cli_run.prepare_environment(args, 1, "1")["FABRIC_NUM_NODES"] == "1:2"
    parsed = _parsed_by_torchrun(_torchrun(["--num-nodes", "2:4", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379", "train.py"]))
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_endpoint) == ("2:4", "etcd", "e:2379")


def test_each_attempt_of_an_elastic_job_takes_the_node_count_its_launcher_started(monkeypatch):
    from fabric_core.connector import elastic_node_count
    from fabric_core.environments import TorchElasticEnvironment

    for name, value in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    env = TorchElasticEnvironment()
    assert elastic_node_count((1, 2), env, 1) == 2
    env.validate_settings(num_devices=1, num_nodes=2)  # the world-size check then holds for every size of the range
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="may only number 1 to 2"):
        elastic_node_count((1, 2), env, 1)
