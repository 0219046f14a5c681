"""Jobs in (simulated) Kubeflow pods: every node configured only by the variables Kubeflow sets, on loopback.

Kubeflow Trainer v2 sets torchrun's ``PET_*`` variables in each pod; the older training operator (v1.8) sets
``PET_NNODES``/``PET_NPROC_PER_NODE``/``PET_NODE_RANK`` beside ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``.
Whether the script runs under ``fabric run`` or as the pod's command (``Fabric()`` starting the node's processes),
the nodes must form the one world torchrun would form: ranks node_rank * nproc + local_rank, one all-reduce over all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jobs import fabric_command, free_port, job_env, start_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

SCRIPT = Path(__file__).parent / "scripts" / "pod_rank.py"
TIMEOUT = 240


def _run_pods(tmp_path: Path, command: list, pod_env) -> list[dict]:
    jobs = [start_job(command, tmp_path / f"pod{node}.txt", env=job_env(**pod_env(node))) for node in (0, 1)]
    for job in jobs:
        assert job.wait(TIMEOUT) == 0, job.output()[-4000:]
        assert not job.leftovers()
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]


def test_fabric_run_in_kubeflow_trainer_v2_pods(tmp_path: Path):
    """`fabric run script.py` with no options in two TrainJob pods: nodes, ranks and rendezvous from PET_*."""
    # multiprocess-check: starts ranks (two pods' `fabric run`, one world of 2)
    port = str(free_port())

    def pod_env(node: int) -> dict[str, str]:
        return {
            "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port,
        }  # fmt: skip

    ranks = _run_pods(tmp_path, [*fabric_command(), SCRIPT, tmp_path, "cli"], pod_env)
    assert [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in ranks] == [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2: one world, not two


def test_fabric_in_older_operator_pods_without_a_launcher(tmp_path: Path):
    """`python script.py` with `Fabric(accelerator="cpu")` in two PyTorchJob (v1.8) pods of 2 processes each, the
    node count given as a range (MIN:MAX): Fabric starts each pod's 2 processes and the 4 join one world, ranks as
    torchrun's static rendezvous would give them (it waits for MAX nodes)."""
    port = str(free_port())

    def pod_env(node: int) -> dict[str, str]:
        return {
            "PET_NNODES": "1:2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "WORLD_SIZE": "4", "RANK": str(node),
        }  # fmt: skip

    ranks = _run_pods(tmp_path, [sys.executable, SCRIPT, tmp_path, "launch"], pod_env)
    assert [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in ranks] == [
        (0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 4), (3, 1, 1, 4),
    ]  # fmt: skip
    assert {r["sum"] for r in ranks} == {10.0}
