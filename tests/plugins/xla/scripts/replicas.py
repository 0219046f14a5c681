"""``strategy="xla"`` on the CPU PJRT device: launch and ranks only. ``CPU_NUM_DEVICES=2 python replicas.py OUT``.

What is checked: the parent does not start the XLA runtime before ``launch`` (torch_xla would refuse to start the
replicas), ``fabric.launch()`` without a function raises the reference's ``TypeError``, every replica gets its own
rank, device and sampler shard, rank 0's return value comes back, and ``devices=1`` runs the function in this process. What is not: any collective. On the CPU, torch_xla
runs the replicas as threads of one process, and their collectives abort in XLA's rendezvous (pytorch/xla#9089);
gradient all-reduce is exercised on TPUs only (see the README).
"""

from __future__ import annotations

import json

import torch
import xla_common as c

from fabric_core import Fabric


def replica(fabric: Fabric, out: str) -> dict:
    value = torch.arange(3.0, device=fabric.device) * 2  # a computation on the replica's own device, no collective
    info = {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "is_global_zero": fabric.is_global_zero,
        "device": str(fabric.device),
        "sampler_kwargs": fabric.strategy.distributed_sampler_kwargs,
        "value": value.cpu().tolist(),
        "fabric_object": id(fabric),
    }
    with open(f"{out}/replica-{fabric.global_rank}.json", "w") as f:
        json.dump(info, f)
    return {"rank": fabric.global_rank, "tensor": value}


def main() -> None:
    out = c.out_dir()
    import torch_xla

    r: dict = {}
    fabric = Fabric(accelerator="tpu", devices="auto")  # several devices: strategy="auto" is "xla"
    r["strategy"] = type(fabric.strategy).__name__
    r["world_size_before_launch"] = fabric.world_size
    r["runtime_started_before_launch"] = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    try:
        fabric.launch()
        r["launch_without_function"] = "accepted"
    except TypeError as err:
        r["launch_without_function"] = str(err)
    fabric = Fabric(accelerator="tpu", strategy="xla", devices="auto")
    result = fabric.launch(replica, str(out))
    r["result_rank"] = result["rank"]
    r["result_tensor_device"] = str(result["tensor"].device)
    r["replicas"] = [json.loads((out / f"replica-{i}.json").read_text()) for i in range(r["world_size_before_launch"])]
    # devices=1: torch_xla runs the function in this process (the replicas above ran in a child, so the runtime of
    # this process is still unstarted, as torch_xla requires)
    single = Fabric(accelerator="tpu", strategy="xla", devices=1)
    r["single_result"] = single.launch(lambda fabric: {"rank": fabric.global_rank, "world_size": fabric.world_size})
    r["single_ran_here"] = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    c.dump(out / "replicas.json", r)


if __name__ == "__main__":
    main()
