"""torchrun's arguments as ``PET_*`` variables (how Kubeflow configures a pod), read by `fabric run` and `Fabric()`.

`fabric run` must hand torchrun the line torchrun itself would have read from the variables: each case below is
judged by torchrun's own parser. The jobs that form one world from two pods are in
tests/plugins/ddp/test_kubeflow_pods.py.
"""

from __future__ import annotations

import logging
import os
import re
from unittest import mock

import pytest
from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes

from fabric_core import cli_run
from fabric_core.connector import apply_torchrun_variables
from fabric_core.environments import KubeflowEnvironment, PlainEnvironment
from fabric_core.environments import torchrun_variables as pet


@pytest.fixture(autouse=True)
def pod(monkeypatch):
    """A process outside any launcher, with no variable of the host machine's that these tests read."""
    for name in list(os.environ):
        if name.startswith(("PET_", "FABRIC_", "TORCHELASTIC_")) or name in (
            "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
        ):  # fmt: skip
            monkeypatch.delenv(name)

    def set_pod(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))

    return set_pod


def _torchrun_alone() -> dict:
    """What torchrun makes of these variables with no option on its command line."""
    parsed = get_args_parser().parse_args(["train.py"])
    return {
        "nodes": parse_min_max_nnodes(parsed.nnodes),
        "nproc": determine_local_world_size(parsed.nproc_per_node),
        "node_rank": parsed.node_rank,
        "master": (parsed.master_addr, parsed.master_port),
        "rdzv": (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id),
        "max_restarts": parsed.max_restarts,
    }


def _through_fabric_run(*options: str) -> dict:
    """What torchrun makes of the line `fabric run [options] train.py` hands it."""
    args = cli_run.parse_run_args([*options, "train.py"])
    line = cli_run.torchrun_arguments(args, int(args.devices))
    parsed = get_args_parser().parse_args(line)
    return {
        "nodes": parse_min_max_nnodes(parsed.nnodes),
        "nproc": determine_local_world_size(parsed.nproc_per_node),
        "node_rank": parsed.node_rank,
        "master": (parsed.master_addr, parsed.master_port),
        "rdzv": (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id),
        "max_restarts": parsed.max_restarts,
    }


def _without_pet() -> None:
    for name in list(os.environ):
        if name.startswith("PET_"):
            del os.environ[name]  # the `pod` fixture's monkeypatch restores what it set


@pytest.mark.parametrize(
    "variables",
    [
        # Kubeflow Trainer v2's torch plugin, in every pod of a TrainJob
        {"PET_NNODES": 3, "PET_NPROC_PER_NODE": 2, "PET_NODE_RANK": 1, "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": 29400},
        # its default processes per node, counted by torchrun's rule
        {"PET_NNODES": 2, "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": 0, "PET_MASTER_ADDR": "head", "PET_MASTER_PORT": 2345},
        # the older operator's elastic policy with a fixed node count: a c10d rendezvous at an endpoint
        {"PET_NNODES": 2, "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_ID": "job", "PET_MAX_RESTARTS": 3},
    ],
    ids=["trainer-v2", "nproc-auto", "operator-elastic-fixed"],
)
def test_fabric_run_hands_torchrun_what_it_would_read_itself(pod, variables):
    pod(**variables)
    alone = _torchrun_alone()
    ours = _through_fabric_run()
    if alone["rdzv"][0] != "static":  # the static rendezvous' address is unused by c10d (torchrun keeps its default)
        alone.pop("master"), ours.pop("master")
    assert ours == alone


def test_a_range_of_nodes_is_the_static_rendezvous_maximum(pod):
    """torchrun's static rendezvous waits for MAX nodes of a MIN:MAX range: the same world from `fabric run`."""
    pod(PET_NNODES="1:2", PET_NPROC_PER_NODE=1, PET_NODE_RANK=1, PET_MASTER_ADDR="head", PET_MASTER_PORT=2345)
    args = cli_run.parse_run_args(["train.py"])
    assert (args.num_nodes, args.node_rank) == (2, 1)
    assert parse_min_max_nnodes(get_args_parser().parse_args(["train.py"]).nnodes)[1] == args.num_nodes


def test_an_elastic_range_reaches_torchrun_as_it_reads_it_and_every_fabric_as_a_range(pod):
    """PET_NNODES=MIN:MAX with an elastic rendezvous (issue 38): `fabric run` hands torchrun the range, and each
    worker's Fabric takes the count of the attempt it runs in."""
    pod(PET_NNODES="1:3", PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT="w0:1234")
    alone = _torchrun_alone()
    args = cli_run.parse_run_args(["train.py"])
    line = cli_run.torchrun_arguments(args, 1)
    parsed = get_args_parser().parse_args(line)
    assert parse_min_max_nnodes(parsed.nnodes) == alone["nodes"] == (1, 3)
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint) == alone["rdzv"][:2]
    with mock.patch.dict(os.environ):  # prepare_environment exports into this process: keep it out of later tests
        assert cli_run.prepare_environment(args, 1, "1")["FABRIC_NUM_NODES"] == "1:3"
    pod(PET_NNODES="3:3")  # MIN = MAX is a fixed count
    assert cli_run.parse_run_args(["train.py"]).num_nodes == 3


def test_explicit_options_win_over_the_variables(pod):
    pod(PET_NNODES=4, PET_NODE_RANK=3, PET_MASTER_ADDR="head", PET_MASTER_PORT=2345, PET_NPROC_PER_NODE=8)
    args = cli_run.parse_run_args(["--num-nodes", "2", "--node-rank=1", "--devices", "2", "train.py", "--main-port", "7"])
    assert (args.num_nodes, args.node_rank, args.devices, args.main_address, args.main_port) == (2, 1, "2", "head", 7)


def test_the_older_operator_names_node_zero_with_master_addr(pod):
    """The v1.8 operator sets PET_NNODES/PET_NODE_RANK but node 0's address only as MASTER_ADDR/MASTER_PORT
    (torchrun alone would meet at 127.0.0.1, which no other pod reaches)."""
    pod(PET_NNODES=2, PET_NPROC_PER_NODE=1, PET_NODE_RANK=1, MASTER_ADDR="job-master-0", MASTER_PORT=23456, WORLD_SIZE=2, RANK=1)
    args = cli_run.parse_run_args(["train.py"])
    assert (args.num_nodes, args.node_rank, args.main_address, args.main_port) == (2, 1, "job-master-0", 23456)
    # Without any PET_* node variable, MASTER_ADDR is not `fabric run`'s (as before, and as the reference).
    _without_pet()
    args = cli_run.parse_run_args(["train.py"])
    assert (args.num_nodes, args.main_address, args.main_port) == (1, "127.0.0.1", cli_run.DEFAULT_MAIN_PORT)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"PET_NNODES": "0"}, r"PET_NNODES='0' must be a number of nodes N or a range MIN:MAX"),
        ({"PET_NNODES": "3:1"}, r"PET_NNODES='3:1'"),
        ({"PET_NNODES": "two"}, r"PET_NNODES='two'"),
        ({"PET_NPROC_PER_NODE": "0"}, r"PET_NPROC_PER_NODE='0' must be a positive number"),
        ({"PET_NPROC_PER_NODE": "many"}, r"PET_NPROC_PER_NODE='many'.*Use a number of processes"),
        ({"PET_NODE_RANK": "x"}, r"PET_NODE_RANK='x' is not a valid value for --node-rank"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, None),
    ],
)
def test_bad_variables_are_usage_errors_naming_them(pod, capsys, tmp_path, variables, message):
    pod(**variables)
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli_run.main([str(script)]) == 2
    err = capsys.readouterr().err
    assert "fabric run: error:" in err
    if message is None:  # a node rank outside the node count: the option's own check, in the option's words
        assert "--node-rank must be between 0 and 1, got 2" in err
    else:
        assert len(re.findall(message, err)) == 1, err


# ---------------------------------------------------------------------------------------------- Fabric()


def test_fabric_defaults_take_the_pods_shape(pod):
    pod(PET_NNODES="1:3", PET_NPROC_PER_NODE=2, PET_NODE_RANK=2, PET_MASTER_ADDR="head", PET_MASTER_PORT=2345)
    given = {"accelerator": "cpu", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": None}
    assert apply_torchrun_variables(given) == {**given, "devices": 2, "num_nodes": 3}
    explicit = {**given, "devices": 4, "num_nodes": 5}
    assert apply_torchrun_variables(explicit) == explicit  # checked by the environment, not replaced
    env = PlainEnvironment()
    assert (env.node_rank(), env.main_address, env.main_port, env.creates_processes_externally) == (2, "head", 2345, False)
    env.validate_settings(num_devices=2, num_nodes=3)
    with pytest.raises(ValueError, match=r"`PET_NNODES=1:3` is set in the environment.*`Fabric\(num_nodes=5\)`.*num_nodes=3"):
        env.validate_settings(num_devices=2, num_nodes=5)
    with pytest.raises(ValueError, match=r"`PET_NPROC_PER_NODE=2` is set.*asks for 4\. Pass `devices=2`"):
        env.validate_settings(num_devices=4, num_nodes=3)


def test_under_a_launcher_the_launcher_read_them(pod):
    pod(PET_NNODES=2, PET_NPROC_PER_NODE=2, TORCHELASTIC_RUN_ID="r")
    given = {"accelerator": "cpu", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": None}
    assert apply_torchrun_variables(given) == given  # torchrun's world (an elastic one may be smaller than MAX)


def test_plain_environment_accepts_the_older_operators_pod_rank(pod):
    """v1.8 pods also carry RANK = the pod's index and WORLD_SIZE = pods * nproc: not a leftover of another job."""
    pod(PET_NNODES=2, PET_NPROC_PER_NODE=2, PET_NODE_RANK=1, MASTER_ADDR="m", MASTER_PORT=1, WORLD_SIZE=4, RANK=1)
    PlainEnvironment().validate_settings(num_devices=2, num_nodes=2)
    pod(RANK=0)
    with pytest.raises(ValueError, match="`RANK=0` is set in the environment, but `LOCAL_RANK` is not"):
        PlainEnvironment().validate_settings(num_devices=2, num_nodes=2)


def test_one_process_per_pod_without_pet_points_to_the_kubeflow_plugin(pod):
    pod(MASTER_ADDR="job-master-0", MASTER_PORT=23456, WORLD_SIZE=2, RANK=1)
    with pytest.raises(ValueError, match=r"In a Kubeflow PyTorchJob pod, pass `plugins=\[KubeflowEnvironment\(\)\]`"):
        PlainEnvironment().validate_settings(num_devices=1, num_nodes=1)


def test_kubeflow_environment_in_a_pod_of_several_processes(pod):
    """torchrun inside a pod (nprocPerNode 2): each process keeps its own local rank and the pod's node rank, so
    the two never share a device (the reference gives both local rank 0)."""
    pod(MASTER_ADDR="m", MASTER_PORT=1, WORLD_SIZE=4, RANK=3, LOCAL_RANK=1, GROUP_RANK=1, PET_NODE_RANK=1)
    env = KubeflowEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    pod(WORLD_SIZE=2, RANK=1)
    for name in ("LOCAL_RANK", "GROUP_RANK", "PET_NODE_RANK"):
        del os.environ[name]
    assert (env.local_rank(), env.node_rank()) == (0, 1)  # one process per pod: its rank is its node's


def test_kubeflow_setters_say_what_the_reference_says(pod, caplog):
    pod(MASTER_ADDR="m", MASTER_PORT=1, WORLD_SIZE=2, RANK=1)
    env = KubeflowEnvironment()
    with caplog.at_level(logging.DEBUG, logger="fabric_core.environments.kubeflow"):
        env.set_world_size(8)
        env.set_global_rank(5)
    assert caplog.messages == [
        "KubeflowEnvironment.set_world_size was called, but setting world size is not allowed. Ignored.",
        "KubeflowEnvironment.set_global_rank was called, but setting global rank is not allowed. Ignored.",
    ]
    assert (env.world_size(), env.global_rank()) == (2, 1)


def test_variable_names_follow_torchruns_rule():
    parser = get_args_parser()
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    for dest, flag in flags.items():
        if dest in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "rdzv_backend", "max_restarts"):
            assert pet.variable_for(flag) == f"PET_{dest.upper()}"
