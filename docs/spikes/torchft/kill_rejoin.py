"""Spike: can a torchft replica group be SIGKILLed and restarted while the other keeps stepping (CPU, gloo)?

Run: ``python docs/spikes/torchft/kill_rejoin.py`` (needs torchft installed beside torch). It starts, as separate
processes, a lighthouse on 127.0.0.1 and two one-process replica groups (each with its own TCPStore), SIGKILLs
replica 1 at step ``KILL_AT``, checks that replica 0's step counter advances while replica 1 is gone, restarts
replica 1, lets both run a few steps together after it rejoined and compares the weights they saved bit for bit. Everything it starts is
killed by pid at the end. Exit code 0 means the spike passed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

KILL_AT = 5
TIMEOUT_S = 240


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse(port: int) -> None:
    from torchft._torchft import LighthouseServer

    # min_replicas=1: one live replica group is a quorum, so replica 0 keeps stepping alone. join_timeout_ms: how
    # long a quorum waits for groups that were not in the previous one (the first quorum waits for both).
    # SPIKE_BIND="[::]" SPIKE_HOSTNAME=default: the previous attempt's all-interfaces bind and hostname announce.
    server = LighthouseServer(bind=os.environ.get("SPIKE_BIND", "127.0.0.1") + f":{port}", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=2000)
    print("lighthouse", server.address(), flush=True)
    while True:
        time.sleep(1)


def replica(replica_id: int, lighthouse_addr: str, out: Path) -> None:
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"replica_{replica_id}",
        **({} if os.environ.get("SPIKE_HOSTNAME") == "default" else {"hostname": "127.0.0.1"}),
    )
    ddp = DistributedDataParallel(manager, model)
    ftopt = Optimizer(manager, opt)
    gen = torch.Generator().manual_seed(1000 + replica_id)
    stop = out.with_suffix(".stop")  # the driver writes the step to stop at once both replicas are back
    while not (stop.exists() and stop.read_text() and manager.current_step() >= int(stop.read_text())):
        x = torch.randn(16, 8, generator=gen)
        ftopt.zero_grad()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        ftopt.step()
        print(f"step {manager.current_step()} participants {manager.num_participants()} loss {loss.item():.5f}",
              flush=True)
        time.sleep(0.05)
    torch.save(model.state_dict(), out)
    print("done", flush=True)
    manager.shutdown(wait=False)


def _last_step(path: Path) -> int:
    steps = [int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith("step ")]
    return steps[-1] if steps else -1


def main() -> int:
    import torch

    work = Path(tempfile.mkdtemp(prefix="ft-spike-"))
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", PYTHONUNBUFFERED="1")
    port = _port()
    addr = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start(*args: str, log: str) -> subprocess.Popen:
        f = open(work / log, "ab")
        p = subprocess.Popen([sys.executable, __file__, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
        procs.append(p)
        return p

    deadline = time.monotonic() + TIMEOUT_S

    def wait_for(cond, what: str) -> None:
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.1)

    try:
        start("lighthouse", str(port), log="lighthouse.log")
        time.sleep(1)
        start("replica", "0", addr, str(work / "r0.pt"), log="r0.log")
        r1 = start("replica", "1", addr, str(work / "r1.pt"), log="r1.log")
        wait_for(lambda: _last_step(work / "r1.log") >= KILL_AT, "replica 1 reaching the kill step")
        os.kill(r1.pid, signal.SIGKILL)
        r1.wait(10)
        t_kill = time.monotonic()
        s0_at_kill = _last_step(work / "r0.log")
        print(f"killed replica 1 at its step {_last_step(work / 'r1.log')}; replica 0 at {s0_at_kill}")
        time.sleep(8)
        s0_absent = _last_step(work / "r0.log")
        print(f"replica 0 after 8 s without replica 1: step {s0_absent}")
        (work / "r1.log").write_text("")
        r1 = start("replica", "1", addr, str(work / "r1.pt"), log="r1.log")
        t_restart = time.monotonic()
        wait_for(lambda: "participants 2" in (work / "r1.log").read_text(), "replica 1 rejoining the quorum")
        stop_at = _last_step(work / "r0.log") + 5
        print(f"replica 1 restarted {t_restart - t_kill:.1f} s after the kill and rejoined; both stop at step {stop_at}")
        for name in ("r0", "r1"):
            (work / f"{name}.stop").write_text(str(stop_at))
        wait_for(lambda: (work / "r0.pt").exists() and (work / "r1.pt").exists(), "both replicas finishing")
        first = [ln for ln in (work / "r1.log").read_text().splitlines() if ln.startswith("step ")][0]
        print(f"replica 1's first step after the restart: {first!r}; last steps {_last_step(work / 'r0.log')},"
              f" {_last_step(work / 'r1.log')}")
        a, b = torch.load(work / "r0.pt"), torch.load(work / "r1.pt")
        same = all(torch.equal(a[k], b[k]) for k in a)
        print("bit-identical weights:", same)
        print("replica 0 stepped during the absence:", s0_absent > s0_at_kill)
        ok = same and s0_absent > s0_at_kill
    except Exception as e:  # noqa: BLE001 - the spike reports whatever went wrong with the logs
        print("FAILED:", repr(e))
        ok = False
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for log in ("lighthouse.log", "r0.log", "r1.log"):
            lines = (work / log).read_text().splitlines()
            print(f"--- {log} (last 15 of {len(lines)} lines)")
            print("\n".join(lines[-15:]))
    print("SPIKE", "PASSED" if ok else "FAILED", work)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "lighthouse":
        lighthouse(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "replica":
        replica(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        sys.exit(main())
