"""Cluster environments: detection, ranks, rendezvous address/port, validation, and priority-based selection."""

from __future__ import annotations

import ast
import logging
import os
import re
import signal
import socket
import sys
import warnings
from pathlib import Path

import pytest

import fabric_core.environments as envs
from fabric_core.environments import (
    BUILTIN_ENVIRONMENTS,
    ClusterEnvironment,
    InvalidEnvironmentVariable,
    KubeflowEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MissingEnvironmentVariable,
    MPIEnvironment,
    PlainEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    find_free_port,
    parse_slurm_nodelist,
    select_environment,
)
from fabric_core.environments import mpi as mpi_module
from fabric_core.environments import slurm as slurm_module
from fabric_core.utilities import rank_zero
from fabric_core.utilities.rank_zero import PossibleUserWarning

_REAL_SRUN_LOOKUP = slurm_module._srun_available  # the autouse fixture hides srun; tests that want it restore this

# Every variable any environment reads; cleared before each test so the host machine cannot influence results.
_ALL_VARS = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "STANDALONE_PORT", "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NODELIST",
    "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    "LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid",
    "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_RDZV_BACKEND",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in _ALL_VARS:
        # setenv first so that monkeypatch records the variable: some environments export MASTER_ADDR/MASTER_PORT,
        # and undoing the test must remove what they wrote.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    # No `srun` here, whatever the machine has: the warning about an unused srun is tested on its own.
    monkeypatch.setattr(slurm_module, "_srun_available", lambda: False)
    previous_rank = rank_zero.get_rank()
    rank_zero.set_rank(0)
    yield
    rank_zero.set_rank(previous_rank)


def _setenv(monkeypatch, **values):
    for key, value in values.items():
        monkeypatch.setenv(key, str(value))


def _exercise(env: ClusterEnvironment) -> None:
    """Call every read-only accessor, as a strategy would."""
    _ = env.creates_processes_externally, env.main_address, env.main_port
    env.world_size()
    env.global_rank()
    env.local_rank()
    env.node_rank()


# ---------------------------------------------------------------------------------------------- base / helpers


def test_base_is_abstract_and_defaults_are_noops():
    with pytest.raises(TypeError):
        ClusterEnvironment()  # type: ignore[abstract]
    env = PlainEnvironment()
    assert ClusterEnvironment.validate_settings(env, num_devices=99, num_nodes=99) is None
    assert ClusterEnvironment.detect_priority is None


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))  # raises if the port was not actually free


def test_missing_variable_error_is_keyerror_with_readable_message():
    err = MissingEnvironmentVariable("WORLD_SIZE", "set it")
    assert isinstance(err, KeyError)
    assert str(err) == "The environment variable `WORLD_SIZE` is not set. set it"


def test_names_and_priorities():
    assert {cls.name for cls in BUILTIN_ENVIRONMENTS} == {
        "plain", "torchelastic", "slurm", "lsf", "mpi", "kubeflow"
    }  # fmt: skip
    ordered = sorted(
        (cls for cls in BUILTIN_ENVIRONMENTS if cls.detect_priority is not None),
        key=lambda c: c.detect_priority,
    )
    assert ordered == [
        TorchElasticEnvironment,
        SLURMEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        PlainEnvironment,
    ]
    assert KubeflowEnvironment.detect_priority is None


def test_exports():
    for name in envs.__all__:
        assert hasattr(envs, name), name


def _imported_at_import_time(tree: ast.AST):
    """The import statements that run when the module is imported (a function's own imports run when it is called)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        yield from _imported_at_import_time(node)


def test_modules_import_only_stdlib():
    """Environments are detected before any process group exists; importing them must stay light."""
    package_dir = Path(envs.__file__).parent
    allowed_internal = {"fabric_core.environments", "fabric_core.utilities.rank_zero", "fabric_core.utilities.lazy"}
    for path in package_dir.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in _imported_at_import_time(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                ok = top in sys.stdlib_module_names or top == "__future__"
                ok = ok or any(module == m or module.startswith(m + ".") for m in allowed_internal)
                assert ok, f"{path.name} imports {module}"


# ---------------------------------------------------------------------------------------------- selection


def test_select_falls_back_to_plain():
    env = select_environment(BUILTIN_ENVIRONMENTS)
    assert type(env) is PlainEnvironment


def test_select_prefers_torchelastic_over_slurm(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="abc", SLURM_NTASKS=4, SLURM_JOB_NAME="train")
    assert TorchElasticEnvironment.detect() and SLURMEnvironment.detect()
    # Order of the iterable must not matter, only detect_priority.
    env = select_environment([PlainEnvironment, SLURMEnvironment, TorchElasticEnvironment])
    assert type(env) is TorchElasticEnvironment


def test_select_picks_slurm_when_no_torchelastic(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS=4, SLURM_NTASKS_PER_NODE=4, SLURM_JOB_NAME="train")
    assert type(select_environment(BUILTIN_ENVIRONMENTS)) is SLURMEnvironment


def test_select_skips_undetectable_and_raises_without_fallback(monkeypatch):
    _setenv(monkeypatch, MASTER_ADDR="h", MASTER_PORT=1, WORLD_SIZE=2, RANK=0)
    with pytest.raises(RuntimeError, match="PlainEnvironment"):
        select_environment([KubeflowEnvironment, SLURMEnvironment])
    assert type(select_environment([KubeflowEnvironment, PlainEnvironment])) is PlainEnvironment


def test_select_treats_class_without_priority_as_explicit_only():
    class Bare:  # a plugin class that never declared detect_priority
        @classmethod
        def detect(cls):
            raise AssertionError("must not be asked")

    assert type(select_environment([Bare, PlainEnvironment])) is PlainEnvironment  # type: ignore[list-item]


def test_select_equal_priority_keeps_given_order():
    class A(PlainEnvironment):
        name = "a"
        detect_priority = 5

    class B(PlainEnvironment):
        name = "b"
        detect_priority = 5

    assert type(select_environment([B, A, PlainEnvironment])) is B


# ---------------------------------------------------------------------------------------------- plain


def test_plain_defaults_without_env():
    env = PlainEnvironment()
    assert PlainEnvironment.detect()
    assert env.creates_processes_externally is False
    assert env.main_address == "127.0.0.1"
    assert env.world_size() == 1
    assert env.global_rank() == 0
    assert env.local_rank() == 0
    assert env.node_rank() == 0


def test_plain_free_port_is_cached(monkeypatch):
    calls = []

    def fake_port():
        calls.append(1)
        return 40000 + len(calls)

    monkeypatch.setattr("fabric_core.environments.plain.find_free_port", fake_port)
    env = PlainEnvironment()
    assert env.main_port == 40001
    assert env.main_port == 40001
    assert len(calls) == 1
    assert "MASTER_PORT" not in os.environ


def test_lightning_environment_is_the_plain_one():
    # The reference's name for the fallback: the same class, so isinstance checks with either name agree.
    assert LightningEnvironment is PlainEnvironment
    assert isinstance(select_environment(BUILTIN_ENVIRONMENTS), LightningEnvironment)
    assert "LightningEnvironment" in envs.__all__


def test_plain_port_standalone_then_free(monkeypatch):
    monkeypatch.setattr("fabric_core.environments.base.socket.socket", None)  # no probing when it is pinned
    _setenv(monkeypatch, STANDALONE_PORT=12345)
    assert find_free_port() == 12345
    assert PlainEnvironment().main_port == 12345
    _setenv(monkeypatch, MASTER_PORT=2222)
    assert PlainEnvironment().main_port == 2222  # MASTER_PORT wins over STANDALONE_PORT
    _setenv(monkeypatch, MASTER_PORT="", STANDALONE_PORT="port")
    with pytest.raises(ValueError, match="`STANDALONE_PORT` must be an integer"):
        _ = PlainEnvironment().main_port


def test_plain_port_is_decided_once(monkeypatch):
    _setenv(monkeypatch, MASTER_PORT=2222)
    env = PlainEnvironment()
    assert env.main_port == 2222
    _setenv(monkeypatch, MASTER_PORT=3333)  # e.g. a launcher exporting its own value later
    assert env.main_port == 2222  # every reader of this object keeps seeing the port the job started with
    assert PlainEnvironment().main_port == 3333


def test_plain_reads_master_vars(monkeypatch):
    _setenv(monkeypatch, MASTER_ADDR="10.0.0.1", MASTER_PORT=1234)
    env = PlainEnvironment()
    assert env.main_address == "10.0.0.1"
    assert env.main_port == 1234


def test_plain_external_reads_world_size_and_rank(monkeypatch):
    _setenv(monkeypatch, LOCAL_RANK=1, WORLD_SIZE=4, RANK=3)
    env = PlainEnvironment()
    assert env.creates_processes_externally is True
    assert env.world_size() == 4
    assert env.global_rank() == 3
    assert env.local_rank() == 1


def test_plain_ignores_world_size_env_when_not_external(monkeypatch):
    _setenv(monkeypatch, WORLD_SIZE=4, RANK=3)
    env = PlainEnvironment()
    assert env.world_size() == 1
    assert env.global_rank() == 0


def test_plain_setters_override_and_update_rank_zero(monkeypatch):
    _setenv(monkeypatch, LOCAL_RANK=0, WORLD_SIZE=4, RANK=0)
    env = PlainEnvironment()
    env.set_world_size(8)
    env.set_global_rank(5)
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert rank_zero.get_rank() == 5
    assert os.environ["WORLD_SIZE"] == "4"  # setters do not write the environment


@pytest.mark.parametrize(
    ("values", "expected"),
    [({}, 0), ({"GROUP_RANK": 2}, 2), ({"NODE_RANK": 3}, 3), ({"NODE_RANK": 3, "GROUP_RANK": 2}, 3)],
)
def test_plain_node_rank(monkeypatch, values, expected):
    _setenv(monkeypatch, **values)
    assert PlainEnvironment().node_rank() == expected


def test_plain_malformed_int_names_variable(monkeypatch):
    _setenv(monkeypatch, LOCAL_RANK="one")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        PlainEnvironment().local_rank()


def test_launcher_teardown_puts_back_what_it_exported(monkeypatch):
    """The parent exports the job's variables for itself; tearing the strategy down restores the old ones."""
    from fabric_core.launchers.subprocess_script import SubprocessScriptLauncher
    from fabric_core.strategies import ParallelStrategy

    _setenv(monkeypatch, WORLD_SIZE=7)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    launcher = SubprocessScriptLauncher(ParallelStrategy())
    launcher._export({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ("WORLD_SIZE", "LOCAL_RANK"))
    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "0")
    launcher.teardown()
    assert os.environ["WORLD_SIZE"] == "7" and "LOCAL_RANK" not in os.environ


# ---------------------------------------------------------------------------------------------- torchelastic


def test_torchelastic_detect(monkeypatch):
    assert not TorchElasticEnvironment.detect()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "")  # present but empty still counts
    assert TorchElasticEnvironment.detect()


def test_torchelastic_ranks_and_address(monkeypatch):
    _setenv(
        monkeypatch, TORCHELASTIC_RUN_ID="r", WORLD_SIZE=8, RANK=5, LOCAL_RANK=1, GROUP_RANK=2,
        MASTER_ADDR="node0", MASTER_PORT=29400,
    )  # fmt: skip
    env = TorchElasticEnvironment()
    assert env.creates_processes_externally is True
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 2
    assert env.main_address == "node0"
    assert env.main_port == 29400


def test_torchelastic_node_rank_defaults_to_zero(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r")
    assert TorchElasticEnvironment().node_rank() == 0


def test_torchelastic_missing_master_warns_and_exports_the_fallback(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r")
    env = TorchElasticEnvironment()
    with pytest.warns(UserWarning, match="MASTER_ADDR environment variable is not defined. Set as localhost"):
        assert env.main_address == "127.0.0.1"
    with pytest.warns(UserWarning, match="MASTER_PORT environment variable is not defined. Set as 12910"):
        assert env.main_port == 12910
    # Exported, as the reference does: the process group and any later reader see the same rendezvous, silently.
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "12910")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.main_address == "127.0.0.1"
        assert TorchElasticEnvironment().main_port == 12910


def test_torchelastic_keeps_what_torchrun_exported(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r", MASTER_ADDR="node0", MASTER_PORT=29400)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = TorchElasticEnvironment()
        assert (env.main_address, env.main_port) == ("node0", 29400)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node0", "29400")


def test_torchelastic_missing_rank_var_is_named(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r")
    with pytest.raises(KeyError, match="WORLD_SIZE.*torchrun"):
        TorchElasticEnvironment().world_size()


def test_torchelastic_setters_ignored_with_debug_log(monkeypatch, caplog):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r", WORLD_SIZE=4, RANK=1)
    env = TorchElasticEnvironment()
    with caplog.at_level(logging.DEBUG, logger="fabric_core.environments.torchelastic"):
        env.set_world_size(100)
        env.set_global_rank(7)
    assert env.world_size() == 4
    assert env.global_rank() == 1
    assert "setting world size is not allowed" in caplog.text
    assert rank_zero.get_rank() == 0


def test_torchelastic_validate_settings(monkeypatch):
    _setenv(monkeypatch, TORCHELASTIC_RUN_ID="r", WORLD_SIZE=8)
    env = TorchElasticEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=re.escape(
        "You set `devices=2` and `num_nodes=2` in Fabric, but the product (2 * 2) does not match the world size (8)."
    )) as exc:  # fmt: skip
        env.validate_settings(num_devices=2, num_nodes=2)
    assert "`torchrun --nnodes=2 --nproc-per-node=2`" in str(exc.value)


# ---------------------------------------------------------------------------------------------- SLURM


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, False),
        ({"SLURM_NTASKS": 2}, True),
        ({"SLURM_NTASKS": 2, "SLURM_JOB_NAME": "train.sh"}, True),
        ({"SLURM_NTASKS": 2, "SLURM_JOB_NAME": "bash"}, False),
        ({"SLURM_NTASKS": 2, "SLURM_JOB_NAME": "interactive"}, False),
        ({"SLURM_JOB_NAME": "train.sh"}, False),
    ],
)
def test_slurm_detect(monkeypatch, values, expected):
    _setenv(monkeypatch, **values)
    assert SLURMEnvironment.detect() is expected


def test_slurm_ranks(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS=8, SLURM_NTASKS_PER_NODE=4, SLURM_PROCID=6, SLURM_LOCALID=2, SLURM_NODEID=1)
    env = SLURMEnvironment()
    assert env.creates_processes_externally is True
    assert env.world_size() == 8
    assert env.global_rank() == 6
    assert env.local_rank() == 2
    assert env.node_rank() == 1
    env.set_world_size(3)
    env.set_global_rank(0)
    assert env.world_size() == 8
    assert env.global_rank() == 6


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("host", ["host"]),
        ("host[5-9]", ["host5", "host6", "host7", "host8", "host9"]),
        ("alpha,beta", ["alpha", "beta"]),
        ("alpha beta", ["alpha", "beta"]),
        ("node[001-003,7]", ["node001", "node002", "node003", "node7"]),
        ("1.2.3.[089, 100-102]", ["1.2.3.089", "1.2.3.100", "1.2.3.101", "1.2.3.102"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
        ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, expected):
    assert parse_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["host[1-2", "host]1[", "host[5-3]", "host[]", "host[a-b]"])
def test_parse_slurm_nodelist_rejects_malformed(nodelist):
    with pytest.raises(ValueError, match="SLURM node list"):
        parse_slurm_nodelist(nodelist)


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("host[5-9]", "host5"),
        ("a,b", "a"),
        ("a b", "a"),
        ("1.2.3.[089, 100-110]", "1.2.3.089"),
        ("n[1-999999]", "n1"),
    ],
)
def test_slurm_main_address_from_nodelist(monkeypatch, nodelist, expected):
    _setenv(monkeypatch, SLURM_NODELIST=nodelist)
    assert SLURMEnvironment().main_address == expected
    assert os.environ["MASTER_ADDR"] == expected  # exported, as the reference does


def test_slurm_main_address_prefers_master_addr(monkeypatch):
    _setenv(monkeypatch, SLURM_NODELIST="host[5-9]", MASTER_ADDR="elsewhere")
    assert SLURMEnvironment().main_address == "elsewhere"
    assert os.environ["MASTER_ADDR"] == "elsewhere"


def test_slurm_main_address_without_nodelist_is_this_machine():
    assert SLURMEnvironment().main_address == "127.0.0.1"
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, 12910),
        ({"SLURM_JOB_ID": "123456789"}, 15000 + 6789),
        ({"SLURM_JOB_ID": "42"}, 15042),
        ({"SLURM_JOB_ID": "not-a-number"}, 12910),
        ({"SLURM_JOB_ID": "123456789", "MASTER_PORT": "5555"}, 5555),
    ],
)
def test_slurm_main_port(monkeypatch, values, expected):
    _setenv(monkeypatch, **values)
    assert SLURMEnvironment().main_port == expected
    assert os.environ["MASTER_PORT"] == str(expected)  # exported (or kept), as the reference does


def test_slurm_job_helpers(monkeypatch):
    assert SLURMEnvironment.job_id() is None
    assert SLURMEnvironment.job_name() is None
    _setenv(monkeypatch, SLURM_JOB_ID=77, SLURM_JOB_NAME="train")
    assert SLURMEnvironment.job_id() == 77
    assert SLURMEnvironment.job_name() == "train"
    for name in ("bash", "interactive"):  # an allocation the script runs in by hand is not its job to requeue
        monkeypatch.setenv("SLURM_JOB_NAME", name)
        assert SLURMEnvironment.job_id() is None
        assert SLURMEnvironment().main_port == 15077  # the port still follows the job id


def test_slurm_requeue_settings(monkeypatch):
    env = SLURMEnvironment()
    assert env.auto_requeue is True
    assert env.requeue_signal is signal.SIGUSR1
    other = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGUSR2)
    assert (other.auto_requeue, other.requeue_signal) == (False, signal.SIGUSR2)
    assert SLURMEnvironment(requeue_signal=int(signal.SIGTERM)).requeue_signal is signal.SIGTERM
    assert "auto_requeue=False" in repr(other)
    monkeypatch.setattr(slurm_module, "_IS_WINDOWS", True)
    assert SLURMEnvironment().requeue_signal is None  # Windows has no SIGUSR1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"auto_requeue": "yes"}, TypeError, r"auto_requeue=\.\.\.\)` must be True or False, got 'yes'"),
        ({"requeue_signal": 12345}, ValueError, r"requeue_signal=12345\)` is not a signal of this platform"),
        ({"requeue_signal": "USR1"}, ValueError, "signal.SIGUSR1"),
    ],
)
def test_slurm_requeue_settings_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        SLURMEnvironment(**kwargs)


def _with_srun(monkeypatch):
    monkeypatch.setattr(slurm_module.shutil, "which", lambda name, *a, **k: "/usr/bin/srun" if name == "srun" else None)
    monkeypatch.setattr(slurm_module, "_srun_available", _REAL_SRUN_LOOKUP)


def test_slurm_warns_when_srun_exists_but_is_not_used(monkeypatch):
    _with_srun(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1", "--a-long-option-that-gets-cut-off", "x" * 50])
    with pytest.warns(PossibleUserWarning, match="The `srun` command is available on your system but is not used") as record:
        assert SLURMEnvironment.detect() is False
    message = str(record[0].message)
    command = " ".join(["srun", os.path.basename(sys.executable), *sys.argv])[:64]
    assert f"prepend your python command with `srun` like so: {command} ..." in message
    assert len(command) == 64
    with pytest.warns(PossibleUserWarning, match="`srun` command is available"):
        SLURMEnvironment()  # constructing it by hand outside srun warns too
    # An interactive allocation: the script was not started by srun either.
    _setenv(monkeypatch, SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=2, SLURM_JOB_NAME="interactive")
    with pytest.warns(PossibleUserWarning, match="`srun` command is available"):
        assert SLURMEnvironment.detect() is False


@pytest.mark.parametrize("case", ["srun_used", "no_srun", "windows", "other_rank"])
def test_slurm_srun_warning_only_where_it_applies(monkeypatch, case):
    _with_srun(monkeypatch)
    if case == "srun_used":
        _setenv(monkeypatch, SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=2, SLURM_JOB_NAME="train")
    elif case == "no_srun":
        monkeypatch.setattr(slurm_module.shutil, "which", lambda name, *a, **k: None)
        assert slurm_module._srun_available() is False
    elif case == "windows":
        monkeypatch.setattr(slurm_module, "_IS_WINDOWS", True)
    else:
        rank_zero.set_rank(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SLURMEnvironment.detect() is (case == "srun_used")
        SLURMEnvironment()


def test_slurm_validate_settings(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS=8, SLURM_NTASKS_PER_NODE=4, SLURM_NNODES=2, SLURM_JOB_NAME="train")
    env = SLURMEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=re.escape(
        "You set `devices=2` in Fabric, but the number of tasks per node configured in SLURM `--ntasks-per-node=4`"
        " does not match. HINT: Set `devices=4`."
    )) as err:  # fmt: skip
        env.validate_settings(num_devices=2, num_nodes=2)
    assert "`#SBATCH --ntasks-per-node=2`" in str(err.value)
    with pytest.raises(ValueError, match=re.escape(
        "You set `num_nodes=3` in Fabric, but the number of nodes configured in SLURM `--nodes=2` does not match."
        " HINT: Set `num_nodes=2`"
    )):  # fmt: skip
        env.validate_settings(num_devices=4, num_nodes=3)


def test_slurm_ntasks_without_per_node_is_refused_at_construction(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS=2, SLURM_JOB_NAME="train")
    with pytest.raises(RuntimeError, match=re.escape(
        "You set `--ntasks=2` in your SLURM bash script, but this variable is not supported."
        " HINT: Use `--ntasks-per-node=2` instead."
    )):  # fmt: skip
        SLURMEnvironment()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    SLURMEnvironment().validate_settings(num_devices=1, num_nodes=1)


def test_slurm_ntasks_check_applies_to_any_strategy(monkeypatch):
    from fabric_core import Fabric

    _setenv(monkeypatch, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0, SLURM_JOB_NAME="train")
    with pytest.raises(RuntimeError, match="You set `--ntasks=2` in your SLURM bash script"):
        Fabric(accelerator="cpu", devices=1)  # detected, so constructed, even for one device
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # not detected: Fabric runs the processes itself
    assert Fabric(accelerator="cpu", devices=1).world_size == 1


def test_slurm_validate_skipped_when_interactive(monkeypatch):
    """In an interactive allocation (`salloc` + a shell) the library starts the processes itself: SLURM's task
    counts are not checked. The same counts in a batch job are refused, so the check is really skipped."""
    _setenv(monkeypatch, SLURM_NTASKS=1, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=1, SLURM_JOB_NAME="bash")
    assert SLURMEnvironment().validate_settings(num_devices=4, num_nodes=2) is None
    monkeypatch.setenv("SLURM_JOB_NAME", "train")  # a batch job: the same settings contradict SLURM's
    with pytest.raises(ValueError, match=r"`devices=4` in Fabric, but .* `--ntasks-per-node=1` does not match"):
        SLURMEnvironment().validate_settings(num_devices=4, num_nodes=2)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    with pytest.raises(ValueError, match=r"`num_nodes=2` in Fabric, but .* `--nodes=1` does not match"):
        SLURMEnvironment().validate_settings(num_devices=4, num_nodes=2)


# ---------------------------------------------------------------------------------------------- LSF


@pytest.fixture
def lsf_job(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch\nnode1\nnode1\nnode2\nnode2\n\n")
    _setenv(
        monkeypatch, LSB_JOBID=123456, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_LOCAL_RANK=1,
        JSM_NAMESPACE_SIZE=4, JSM_NAMESPACE_RANK=3,
    )  # fmt: skip
    monkeypatch.setattr(socket, "gethostname", lambda: "node2")
    return rankfile


def test_lsf_detect_needs_all_vars(monkeypatch, lsf_job):
    assert LSFEnvironment.detect()
    monkeypatch.delenv("JSM_NAMESPACE_SIZE")
    assert not LSFEnvironment.detect()


def test_lsf_ranks_and_hosts(lsf_job):
    env = LSFEnvironment()
    assert env.creates_processes_externally is True
    assert env.world_size() == 4
    assert env.global_rank() == 3
    assert env.local_rank() == 1
    assert env.main_address == "node1"  # the launch node is skipped
    assert env.node_rank() == 1  # node2 is the second distinct compute host
    assert env.main_port == 123456 % 1000 + 10000
    env.set_world_size(1)
    env.set_global_rank(0)
    assert env.world_size() == 4
    assert env.global_rank() == 3


def test_lsf_master_vars_win(monkeypatch, lsf_job):
    _setenv(monkeypatch, MASTER_ADDR="other", MASTER_PORT=4242)
    env = LSFEnvironment()
    assert env.main_address == "other"
    assert env.main_port == 4242


def test_lsf_exports_the_rendezvous_at_construction(lsf_job):
    LSFEnvironment()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node1", str(123456 % 1000 + 10000))


@pytest.mark.parametrize(
    ("var", "what"),
    [("JSM_NAMESPACE_SIZE", "world size"), ("JSM_NAMESPACE_RANK", "global rank"), ("JSM_NAMESPACE_LOCAL_RANK", "local rank")],
)
def test_lsf_missing_rank_variable(monkeypatch, lsf_job, var, what):
    env = LSFEnvironment()
    monkeypatch.delenv(var)
    accessor = {"world size": env.world_size, "global rank": env.global_rank, "local rank": env.local_rank}[what]
    with pytest.raises(ValueError, match=re.escape(
        f"Cannot determine {what}. Environment variable `{var}` not found. Make sure you run your executable with `jsrun`."
    )) as err:  # fmt: skip
        accessor()
    assert isinstance(err.value, KeyError)  # also our type for a missing variable


def test_lsf_unknown_host(monkeypatch, lsf_job):
    monkeypatch.setattr(socket, "gethostname", lambda: "stranger")
    with pytest.raises(ValueError, match="stranger"):
        LSFEnvironment().node_rank()


def test_lsf_missing_rankfile(monkeypatch, tmp_path, lsf_job):
    monkeypatch.setenv("LSB_DJOB_RANKFILE", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="Cannot read the LSF rankfile"):
        LSFEnvironment()
    monkeypatch.delenv("LSB_DJOB_RANKFILE")
    with pytest.raises(ValueError, match="Did not find the environment variable `LSB_DJOB_RANKFILE`") as err:
        LSFEnvironment()
    assert isinstance(err.value, InvalidEnvironmentVariable) and isinstance(err.value, KeyError)
    monkeypatch.setenv("LSB_DJOB_RANKFILE", "")
    with pytest.raises(InvalidEnvironmentVariable, match="The environment variable `LSB_DJOB_RANKFILE` is empty"):
        LSFEnvironment()


@pytest.mark.parametrize(
    ("content", "match"), [("", "is empty"), ("\n\n", "is empty"), ("launch\n", "only the launch")]
)
def test_lsf_empty_rankfile(lsf_job, content, match):
    lsf_job.write_text(content)
    with pytest.raises(ValueError, match=match):
        LSFEnvironment()


def test_lsf_missing_job_id_is_refused_at_construction(monkeypatch, lsf_job):
    monkeypatch.delenv("LSB_JOBID")
    with pytest.raises(ValueError, match="Could not find job id in environment variable LSB_JOBID") as err:
        LSFEnvironment()
    assert isinstance(err.value, KeyError) and "set MASTER_PORT" in str(err.value)
    monkeypatch.setenv("MASTER_PORT", "4242")  # the job id only serves to derive the port
    assert LSFEnvironment().main_port == 4242


# ---------------------------------------------------------------------------------------------- MPI


def test_mpi_detect_without_mpi4py_does_not_import_it(monkeypatch):
    _setenv(monkeypatch, OMPI_COMM_WORLD_SIZE=4)
    had_mpi4py = "mpi4py" in sys.modules
    monkeypatch.setattr(mpi_module, "_mpi4py_available", lambda: False)
    assert not MPIEnvironment.detect()
    if not had_mpi4py:
        assert "mpi4py" not in sys.modules
    # The real check must not import it either.
    mpi_module._mpi4py_available()
    if not had_mpi4py:
        assert "mpi4py" not in sys.modules


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, False),
        ({"OMPI_COMM_WORLD_SIZE": 1}, False),
        ({"OMPI_COMM_WORLD_SIZE": 2}, True),
        ({"PMI_SIZE": 3}, True),
        ({"PMI_SIZE": 1}, False),
        ({"PMI_SIZE": "garbage"}, False),
    ],
)
def test_mpi_detect_with_mpi4py(monkeypatch, values, expected):
    monkeypatch.setattr(mpi_module, "_mpi4py_available", lambda: True)
    _setenv(monkeypatch, **values)
    assert MPIEnvironment.detect() is expected


def test_mpi_openmpi_vars(monkeypatch):
    _setenv(
        monkeypatch, OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_LOCAL_RANK=1,
        OMPI_COMM_WORLD_LOCAL_SIZE=4,
    )  # fmt: skip
    env = MPIEnvironment()
    assert env.creates_processes_externally is True
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 1
    env.set_world_size(2)
    env.set_global_rank(0)
    assert (env.world_size(), env.global_rank()) == (8, 5)


def test_mpi_pmi_vars(monkeypatch):
    _setenv(monkeypatch, PMI_SIZE=6, PMI_RANK=4, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=3)
    env = MPIEnvironment()
    assert env.world_size() == 6
    assert env.global_rank() == 4
    assert env.local_rank() == 1
    assert env.node_rank() == 1


def test_mpi_node_rank_without_local_size(monkeypatch):
    _setenv(monkeypatch, PMI_SIZE=2, PMI_RANK=1)
    assert MPIEnvironment().node_rank() == 0


def test_mpi_missing_rank_names_both_variables():
    with pytest.raises(KeyError, match="OMPI_COMM_WORLD_RANK.*PMI_RANK"):
        MPIEnvironment().global_rank()


def test_mpi_address_and_port(monkeypatch):
    env = MPIEnvironment()
    assert env.main_address == "127.0.0.1"
    assert env.main_port == 12910
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1234@1")
    derived = env.main_port
    assert 15000 <= derived < 25000
    assert derived == MPIEnvironment().main_port  # every rank derives the same port
    _setenv(monkeypatch, MASTER_ADDR="head", MASTER_PORT=3000)
    assert env.main_address == "head"
    assert env.main_port == 3000


def test_mpi_validate_settings(monkeypatch):
    _setenv(monkeypatch, OMPI_COMM_WORLD_SIZE=4)
    env = MPIEnvironment()
    env.validate_settings(num_devices=4, num_nodes=1)
    with pytest.raises(ValueError, match=r"devices=2.*num_nodes=1.*started 4"):
        env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        env.validate_settings(num_devices=2, num_nodes=2)
    monkeypatch.setenv("MASTER_ADDR", "head")
    env.validate_settings(num_devices=2, num_nodes=2)


# ---------------------------------------------------------------------------------------------- Kubeflow


def test_kubeflow_never_detected(monkeypatch):
    _setenv(monkeypatch, MASTER_ADDR="m", MASTER_PORT=1, WORLD_SIZE=2, RANK=1)
    with pytest.raises(NotImplementedError, match="The Kubeflow environment can't be detected automatically") as err:
        KubeflowEnvironment.detect()
    assert "plugins=[KubeflowEnvironment()]" in str(err.value)
    # Selection never asks it, so having it among the candidates is harmless.
    assert type(select_environment([KubeflowEnvironment, *BUILTIN_ENVIRONMENTS])) is PlainEnvironment


def test_kubeflow_values(monkeypatch):
    _setenv(monkeypatch, MASTER_ADDR="master-0", MASTER_PORT=23456, WORLD_SIZE=4, RANK=2)
    env = KubeflowEnvironment()
    assert env.creates_processes_externally is True
    assert env.main_address == "master-0"
    assert env.main_port == 23456
    assert env.world_size() == 4
    assert env.global_rank() == 2
    assert env.local_rank() == 0  # one process per pod (several: tests/core/test_torchrun_variables.py)
    assert env.node_rank() == 2
    env.set_world_size(1)
    env.set_global_rank(0)
    assert (env.world_size(), env.global_rank()) == (4, 2)


@pytest.mark.parametrize(
    ("missing", "accessor"),
    [
        ("MASTER_ADDR", lambda e: e.main_address),
        ("MASTER_PORT", lambda e: e.main_port),
        ("WORLD_SIZE", lambda e: e.world_size()),
        ("RANK", lambda e: e.global_rank()),
    ],
)
def test_kubeflow_missing_var_is_named(monkeypatch, missing, accessor):
    _setenv(monkeypatch, MASTER_ADDR="master-0", MASTER_PORT=23456, WORLD_SIZE=4, RANK=2)
    monkeypatch.delenv(missing)
    with pytest.raises(KeyError, match=f"`{missing}`.*Kubeflow"):
        accessor(KubeflowEnvironment())


# ---------------------------------------------------------------------------------------------- no leaks


def _lsf_setup(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch\nhostA\n")
    monkeypatch.setattr(socket, "gethostname", lambda: "hostA")
    return {
        "LSB_JOBID": 1, "LSB_DJOB_RANKFILE": rankfile, "JSM_NAMESPACE_LOCAL_RANK": 0, "JSM_NAMESPACE_SIZE": 1,
        "JSM_NAMESPACE_RANK": 0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (PlainEnvironment, {}),
        (PlainEnvironment, {"LOCAL_RANK": 1, "WORLD_SIZE": 2, "RANK": 1}),
        (MPIEnvironment, {"PMI_SIZE": 2, "PMI_RANK": 1, "MPI_LOCALRANKID": 1}),
        (KubeflowEnvironment, {"MASTER_ADDR": "m", "MASTER_PORT": 1, "WORLD_SIZE": 2, "RANK": 1}),
    ],
)  # fmt: skip
def test_reading_these_environments_never_writes_os_environ(monkeypatch, cls, values):
    _setenv(monkeypatch, **values)
    before = dict(os.environ)
    env = cls()
    _exercise(env)
    env.validate_settings(num_devices=env.world_size(), num_nodes=1)
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (TorchElasticEnvironment, {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": 2, "RANK": 1, "LOCAL_RANK": 1}),
        (
            SLURMEnvironment,
            {"SLURM_NTASKS": 2, "SLURM_PROCID": 1, "SLURM_LOCALID": 1, "SLURM_NODEID": 0,
             "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_ID": 99, "SLURM_NTASKS_PER_NODE": 2, "SLURM_NNODES": 1},
        ),
        (LSFEnvironment, None),
    ],
)  # fmt: skip
def test_these_environments_export_exactly_the_rendezvous_they_report(monkeypatch, tmp_path, cls, values):
    """As in the reference: MASTER_ADDR/MASTER_PORT, with the values the environment reports, and nothing else."""
    if values is None:
        values = _lsf_setup(monkeypatch, tmp_path)
    _setenv(monkeypatch, **values)
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = cls()
        _exercise(env)
        env.validate_settings(num_devices=env.world_size(), num_nodes=1)
    assert dict(os.environ) == {**before, "MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port)}


# ------------------------------------------------------------------------------------------------ stray variables
STRAY = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launcher_variables(monkeypatch):
    for var in STRAY:
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in os.environ if v.startswith(("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "LSB_", "FABRIC_"))]:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _parallel_fabric(devices=2, num_nodes=1):
    from fabric_core import Fabric
    from fabric_core.strategies import ParallelStrategy

    return Fabric(accelerator="cpu", strategy=ParallelStrategy(), devices=devices, num_nodes=num_nodes)


@pytest.mark.parametrize(
    ("variables", "match"),
    [
        ({"LOCAL_RANK": "1"}, r"`LOCAL_RANK=1` is set .* but `RANK` and `WORLD_SIZE` are not set"),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, r"`LOCAL_RANK=1` is set .* but `RANK` is not set"),
        ({"WORLD_SIZE": "4", "RANK": "0"}, r"`WORLD_SIZE=4` is set in the environment, but `LOCAL_RANK` is not"),
        ({"RANK": "1"}, r"`RANK=1` is set in the environment, but `LOCAL_RANK` is not"),
        ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "4"}, r"`WORLD_SIZE=4` is set .* runs 2 processes"),
        ({"LOCAL_RANK": "0", "RANK": "5", "WORLD_SIZE": "2"}, r"`RANK=5` .* between 0 and 1"),
        ({"LOCAL_RANK": "3", "RANK": "1", "WORLD_SIZE": "2"}, r"`LOCAL_RANK=3` .* between 0 and 1"),
    ],
    ids=["local-rank-alone", "no-rank", "world-without-local", "rank-without-local", "world-mismatch", "rank-range", "local-range"],
)
def test_stray_rank_variables_are_refused_by_name(no_launcher_variables, variables, match):
    for key, value in variables.items():
        no_launcher_variables.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        _parallel_fabric(devices=2)


def test_a_complete_consistent_set_of_launcher_variables_is_accepted(no_launcher_variables):
    for key, value in {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}.items():
        no_launcher_variables.setenv(key, value)
    fabric = _parallel_fabric(devices=2)
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size) == (1, 1, 2)
    assert fabric.strategy.launcher is None  # the processes exist already
    # Our own launcher's value left in the parent (same world size) is not a contradiction either.
    no_launcher_variables.delenv("LOCAL_RANK")
    no_launcher_variables.delenv("RANK")
    assert _parallel_fabric(devices=2).world_size == 2


# ------------------------------------------------------------------------------------- ranks set by the strategy


class ExternalEnvironment(ClusterEnvironment):
    """A scheduler of the user's that starts every process but only knows the local and node rank."""

    name = "external"

    def __init__(self, local_rank=0, node_rank=0):
        self._local, self._node = local_rank, node_rank
        self.world, self.rank = None, None

    creates_processes_externally = True
    main_address = "127.0.0.1"
    main_port = 1234

    @classmethod
    def detect(cls):
        return False

    def world_size(self):
        return self.world

    def set_world_size(self, size):
        self.world = size

    def global_rank(self):
        return self.rank if self.rank is not None else 0

    def set_global_rank(self, rank):
        self.rank = rank

    def local_rank(self):
        return self._local

    def node_rank(self):
        return self._node


def test_an_external_environment_is_told_its_world_size_and_rank(no_launcher_variables):
    from fabric_core import Fabric
    from fabric_core.strategies import ParallelStrategy

    env = ExternalEnvironment(local_rank=1, node_rank=1)
    fabric = Fabric(accelerator="cpu", strategy=ParallelStrategy(), devices=2, num_nodes=2, plugins=[env])
    assert (env.world, env.rank) == (4, 3)
    assert (fabric.world_size, fabric.global_rank, fabric.node_rank, fabric.local_rank) == (4, 3, 1, 1)
    assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
    assert fabric.strategy.launcher is None  # it started the processes
    assert rank_zero.get_rank() == 3


def test_owning_environments_ignore_the_strategy(no_launcher_variables):
    from fabric_core import Fabric
    from fabric_core.strategies import ParallelStrategy

    _setenv(no_launcher_variables, TORCHELASTIC_RUN_ID="r", WORLD_SIZE=4, RANK=2, LOCAL_RANK=0, GROUP_RANK=1)
    fabric = Fabric(accelerator="cpu", strategy=ParallelStrategy(), devices=2, num_nodes=2)
    assert type(fabric.strategy.cluster_environment) is TorchElasticEnvironment
    assert (fabric.world_size, fabric.global_rank) == (4, 2)


def test_plain_with_launcher_variables_takes_ranks_from_the_topology(no_launcher_variables):
    _setenv(no_launcher_variables, LOCAL_RANK=1, NODE_RANK=1, RANK=3, WORLD_SIZE=4, MASTER_PORT=1234)
    fabric = _parallel_fabric(devices=2, num_nodes=2)
    assert (fabric.world_size, fabric.global_rank, fabric.node_rank, fabric.local_rank) == (4, 3, 1, 1)
    assert fabric.strategy.launcher is None


def test_plain_refuses_a_rank_the_topology_contradicts(no_launcher_variables):
    # Rank 3 of 4, but without NODE_RANK this process is node 0: the strategy would make it rank 1.
    _setenv(no_launcher_variables, LOCAL_RANK=1, RANK=3, WORLD_SIZE=4)
    with pytest.raises(ValueError, match=r"`RANK=3` is set .* rank 0 \* 2 \+ 1 = 1\. Export NODE_RANK"):
        _parallel_fabric(devices=2, num_nodes=2)
    no_launcher_variables.setenv("GROUP_RANK", "1")  # torch's elastic agent name for it is honoured too
    assert _parallel_fabric(devices=2, num_nodes=2).global_rank == 3


@pytest.mark.parametrize("node_rank", [0, 1])
def test_our_launchers_children_agree_with_the_strategy(no_launcher_variables, node_rank):
    """Each child the subprocess launcher would start, given its environment, settles on the rank it was given."""
    no_launcher_variables.setenv("NODE_RANK", str(node_rank))
    no_launcher_variables.setenv("MASTER_ADDR", "127.0.0.1")
    parent = _parallel_fabric(devices=3, num_nodes=2)
    launcher = parent.strategy.launcher
    assert launcher is not None
    for local_rank in range(3):
        child = launcher.child_environment(parent.strategy.cluster_environment, local_rank)
        for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            no_launcher_variables.setenv(var, child[var])
        fabric = _parallel_fabric(devices=3, num_nodes=2)  # validates the variables, then sets the ranks
        assert fabric.global_rank == int(child["RANK"]) == node_rank * 3 + local_rank
        assert fabric.world_size == int(child["WORLD_SIZE"]) == 6
        assert fabric.strategy.launcher is None
        for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            no_launcher_variables.delenv(var)


# ------------------------------------------------------------------------------- what is validated at construction


def test_launcher_counts_are_checked_when_devices_are_given(no_launcher_variables):
    _setenv(no_launcher_variables, TORCHELASTIC_RUN_ID="r", WORLD_SIZE=4, RANK=0, LOCAL_RANK=0)
    with pytest.raises(ValueError, match=r"the product \(2 \* 1\) does not match the world size \(4\)"):
        _parallel_fabric(devices=2)
    assert _parallel_fabric(devices=4).world_size == 4


@pytest.mark.parametrize(
    "variables",
    [
        {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": 4, "RANK": 1, "LOCAL_RANK": 1},
        {"SLURM_NTASKS": 4, "SLURM_NTASKS_PER_NODE": 4, "SLURM_NNODES": 1, "SLURM_PROCID": 1, "SLURM_LOCALID": 1,
         "SLURM_NODEID": 0, "SLURM_JOB_NAME": "train"},
    ],
    ids=["torchelastic", "slurm"],
)  # fmt: skip
def test_devices_auto_is_not_checked_against_a_launchers_counts(no_launcher_variables, variables):
    # "auto" is 1 process on the CPU (all GPUs on a GPU node): no statement about how many the launcher started.
    _setenv(no_launcher_variables, **variables)
    fabric = _parallel_fabric(devices="auto")
    assert (fabric.world_size, fabric.global_rank) == (4, 1)
    assert fabric.strategy.launcher is None


def test_devices_auto_still_checks_variables_the_world_size_follows(no_launcher_variables):
    # Under the fallback environment the world size follows `devices`: a stray LOCAL_RANK is refused even for "auto".
    assert PlainEnvironment.ranks_follow_devices and not TorchElasticEnvironment.ranks_follow_devices
    _setenv(no_launcher_variables, LOCAL_RANK=1)
    with pytest.raises(ValueError, match="`LOCAL_RANK=1` is set"):
        _parallel_fabric(devices="auto")
