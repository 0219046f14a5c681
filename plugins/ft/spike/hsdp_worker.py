"""One process of one replica group: FSDP2 over the group (gloo), torchft across groups via the all-reduce hook."""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn

out = sys.argv[1]; stopfile = sys.argv[2]
def stop_at():
    try: return int(open(stopfile).read())
    except Exception: return 10**9
group = int(os.environ["REPLICA_GROUP_ID"]); rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, FSDPModule
from torch.distributed.tensor import DTensor
from torchft import Manager
from torchft.process_group import ProcessGroupGloo
from torchft.optim import OptimizerWrapper

mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1, timeout=timedelta(seconds=10),
                  quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10),
                  rank=rank, world_size=ws, store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                  lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=f"g{group}", hostname="127.0.0.1")

def local(sd):
    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in sd.items()}
def load_model(sd):
    with torch.no_grad():
        for k, p in model.state_dict().items():
            (p.to_local() if isinstance(p, DTensor) else p).copy_(sd[k])
manager.register_state_dict_fn("model", load_model, lambda: local(model.state_dict()))
params = list(model.parameters())
def opt_state():
    sd = opt.state_dict()
    return {"state": {i: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in s.items()} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}
def opt_load(sd):
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v) for k, v in s.items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
manager.register_state_dict_fn("optim", opt_load, opt_state)

def hook(output):
    manager.allreduce(output).wait()
for m in model.modules():
    if isinstance(m, FSDPModule):
        m.set_all_reduce_hook(hook)
optim = OptimizerWrapper(manager, opt)

g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g); y = x @ torch.randn(8, 1, generator=g)
log = open(f"{out}.jsonl", "a")
while manager.current_step() < stop_at():
    optim.zero_grad()
    i = manager.current_step() % 8
    xb, yb = x[i*32:(i+1)*32], y[i*32:(i+1)*32]
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    optim.step()
    log.write(json.dumps({"step": manager.current_step(), "n": manager.num_participants(), "loss": loss.item(), "t": time.time()}) + "\n"); log.flush()
    time.sleep(0.05)
torch.save({k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}, f"{out}.pt")
manager.shutdown(wait=False)
dist.destroy_process_group()
