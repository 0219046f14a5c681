"""Spike (issue 41): HSDP whose replicas come and go, with torchft 0.2.0 and torch's FSDP2 on CPU (gloo).

Two replica groups of two processes each: FSDP2 (`fully_shard`) shards the model over a group's processes, and
torchft averages every reduce-scattered gradient shard across the groups through FSDP2's all-reduce hook
(`manager.allreduce`, the same group rank of every group). One process of group 1 is SIGKILLed, the other one is
killed at once (what a group's launcher does), group 0 goes on alone, group 1 is started again and copies each
process's own shards (local tensors of the DTensors, no mesh pickled) from its counterpart in group 0.

``python hsdp_kill_rejoin.py`` prints what happened and ``SPIKE PASSED`` when both groups end bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _last(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return None


def worker(out: str, stopfile: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    group, rank, world = (int(os.environ[k]) for k in ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None, min_replica_size=1,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10),
        rank=rank, world_size=world, store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=f"g{group}", hostname="127.0.0.1",
    )  # fmt: skip

    def local(value):  # noqa: ANN001, ANN202
        return value.to_local() if isinstance(value, DTensor) else value

    def load_model(state):  # noqa: ANN001, ANN202
        with torch.no_grad():
            for key, value in model.state_dict().items():
                local(value).copy_(state[key])

    manager.register_state_dict_fn("model", load_model, lambda: {k: local(v) for k, v in model.state_dict().items()})
    params = list(model.parameters())

    def save_opt():  # noqa: ANN202
        state = opt.state_dict()
        return {"state": {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()},
                "param_groups": state["param_groups"]}  # fmt: skip

    def load_opt(state):  # noqa: ANN001, ANN202
        def back(p, v):  # noqa: ANN001, ANN202
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0:
                return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            return v

        restored = {i: {k: back(params[int(i)], v) for k, v in s.items()} for i, s in state["state"].items()}
        opt.load_state_dict({"state": restored, "param_groups": state["param_groups"]})

    manager.register_state_dict_fn("optim", load_opt, save_opt)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda output: manager.allreduce(output).wait())
    optim = OptimizerWrapper(manager, opt)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator)

    def stop_at() -> int:
        try:
            return int(Path(stopfile).read_text())
        except (OSError, ValueError):
            return 10**9

    with open(f"{out}.jsonl", "a") as log:
        while manager.current_step() < stop_at():
            optim.zero_grad()
            i = manager.current_step() % 8
            loss = nn.functional.mse_loss(model(x[i * 32 : (i + 1) * 32]), y[i * 32 : (i + 1) * 32])
            loss.backward()
            optim.step()
            log.write(json.dumps({"step": manager.current_step(), "n": manager.num_participants()}) + "\n")
            log.flush()
            time.sleep(0.05)
    torch.save({k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}, f"{out}.pt")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def main() -> None:
    import torch

    work = Path(tempfile.mkdtemp(prefix="hsdp-spike-"))
    port = _port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    command = [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1", "--join_timeout_ms", "2000"]
    lighthouse = subprocess.Popen([*command, "--heartbeat_timeout_ms", "2000"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def start(group: int, tag: str) -> list[subprocess.Popen]:
        rendezvous, procs = _port(), []
        for rank in range(2):
            env = dict(os.environ, REPLICA_GROUP_ID=str(group), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous), OMP_NUM_THREADS="1",
                       TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")  # fmt: skip
            log = open(work / f"{tag}_r{rank}.log", "w")  # noqa: SIM115 - closed with the process
            argv = [sys.executable, __file__, "worker", str(work / f"{tag}_r{rank}"), str(work / "stop")]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        return procs

    def wait_for(condition, what: str) -> dict:  # noqa: ANN001
        deadline = time.time() + 240
        while time.time() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(0.2)
        raise SystemExit(f"timed out waiting for {what} (logs in {work})")

    g0, g1 = start(0, "g0"), start(1, "g1")
    wait_for(lambda: (r := _last(work / "g1_r0.jsonl")) and r["step"] >= 15 and r["n"] == 2 and r, "both groups")
    for proc in reversed(g1):  # one process dies; its launcher ends the other at once
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = _last(work / "g0_r0.jsonl")["step"]
    time.sleep(5)
    print(f"group 0 went on alone: step {before} -> {_last(work / 'g0_r0.jsonl')['step']}")
    g1 = start(1, "g1b")
    back = wait_for(lambda: (r := _last(work / "g1b_r0.jsonl")) and r["n"] == 2 and r, "group 1 back")
    print(f"group 1 restarted and rejoined at step {back['step']}")
    (work / "stop").write_text(str(back["step"] + 10))
    codes = [proc.wait(300) for proc in g0 + g1]
    lighthouse.terminate()
    lighthouse.wait()
    same = all(
        torch.equal(a, b)
        for rank in range(2)
        for a, b in zip(torch.load(work / f"g0_r{rank}.pt").values(), torch.load(work / f"g1b_r{rank}.pt").values())
    )
    print(f"exit codes {codes}; bit-identical weights in every rank: {same}")
    print("SPIKE PASSED" if same and not any(codes) else "SPIKE FAILED")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
