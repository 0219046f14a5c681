"""The reference's collectives API on real processes (gloo): every collective on the world group and on
subgroups, send/recv, broadcast within a subset of ranks, objects, and the decoupled player/trainer pattern of the
reference's PPO example. Run by ``fabric run --devices=N`` (or torchrun); writes ``<out>/rank<r>.json``."""

import json
import sys
from pathlib import Path

import torch

from fabric_core import Fabric
from fabric_core.collectives import CollectibleGroup, TorchCollective


def check_world(world: TorchCollective) -> dict:
    rank, size = world.rank, world.world_size
    seen = {"rank": rank, "size": size}
    t = torch.tensor([rank + 1.0])
    seen["all_reduce"] = world.all_reduce(t, op="sum").item()
    seen["all_reduce_max"] = world.all_reduce(torch.tensor([float(rank)]), op="MAX").item()
    b = torch.tensor([float(rank)])
    seen["broadcast_from_last"] = world.broadcast(b, src=size - 1).item()
    gathered = world.all_gather([torch.zeros(1) for _ in range(size)], torch.tensor([rank * 10.0]))
    seen["all_gather"] = [g.item() for g in gathered]
    r = world.reduce(torch.tensor([1.0]), dst=0, op="sum")
    if rank == 0:
        seen["reduce_at_0"] = r.item()
    gather_list = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
    world.gather(torch.tensor([rank + 100.0]), gather_list, dst=0)
    if rank == 0:
        seen["gather_at_0"] = [g.item() for g in gather_list]
    scattered = world.scatter(torch.zeros(1), [torch.tensor([i * 2.0]) for i in range(size)] if rank == 0 else None, src=0)
    seen["scatter"] = scattered.item()
    # point to point: rank 0 sends to each peer in turn; the peer answers with ten times the value
    if rank == 0:
        answers = []
        for peer in range(1, size):
            world.send(torch.tensor([float(peer)]), dst=peer, tag=peer)
            answers.append(world.recv(torch.zeros(1), src=peer, tag=peer).item())
        seen["answers"] = answers
    else:
        got = world.recv(torch.zeros(1), src=0, tag=rank)
        world.send(got * 10, dst=0, tag=rank)
    objects = world.all_gather_object([None] * size, {"rank": rank})
    seen["all_gather_object"] = [o["rank"] for o in objects]
    received = [None]
    world.scatter_object_list(received, [f"item{i}" for i in range(size)] if rank == 0 else None, src=0)
    seen["scatter_object"] = received[0]
    world.barrier()
    return seen


def check_pair(rank: int) -> dict:
    """A collective that owns a group of ranks 0 and 1 only; other ranks are outside it."""
    pair = TorchCollective().create_group(ranks=[0, 1])
    seen = {"pair_rank": pair.rank, "pair_size": pair.world_size}
    if rank in (0, 1):
        seen["pair_broadcast"] = pair.broadcast(torch.tensor([float(rank) + 5.0]), src=1).item()
        seen["pair_sum"] = pair.all_reduce(torch.tensor([1.0])).item()
    pair.barrier()  # returns at once outside the group
    pair.teardown()
    return seen


def decoupled(world: TorchCollective, player_trainer: TorchCollective, optimization_pg: CollectibleGroup) -> dict:
    """Rank 0 (player) makes data and scatters it to the trainers (ranks 1..N-1), which train one model together
    in their own group with DDP over it; trainer 1 sends the new weights back to the player."""
    rank, size = world.rank, world.world_size
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if rank == 0:
        fabric = Fabric(accelerator="cpu", devices=size)  # the player's own (logging) Fabric, as `fabric run` makes it
        weights = torch.nn.utils.parameters_to_vector(model.parameters())
        player_trainer.broadcast(weights, src=1)  # the first trainer's initial weights
        data = torch.randn(6 * (size - 1), 4)
        chunks = [None] + [{"x": c} for c in data.chunk(size - 1)]
        world.scatter_object_list([None], chunks, src=0)
        metrics = [None]
        player_trainer.broadcast_object_list(metrics, src=1)
        player_trainer.broadcast(weights, src=1)
        # the large-batch step the trainers should have taken together
        model.zero_grad()
        model(data).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        expected = torch.nn.utils.parameters_to_vector(model.parameters())
        return {"role": "player", "weights_match": torch.allclose(weights, expected, atol=1e-6), "metrics": metrics[0], "fabric_ranks": fabric.world_size}
    from fabric_ddp import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=size, strategy=DDPStrategy(process_group=optimization_pg))
    fabric.launch()  # the default group exists already (the collectives set it up): Fabric uses it
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 1:
        player_trainer.broadcast(torch.nn.utils.parameters_to_vector(model.parameters()), src=1)
    data = [None]
    world.scatter_object_list(data, None, src=0)
    loss = model(data[0]["x"]).pow(2).mean()
    fabric.backward(loss)  # DDP averages gradients over the trainers' group only
    optimizer.step()
    if rank == 1:
        player_trainer.broadcast_object_list([{"loss": loss.item()}], src=1)
        player_trainer.broadcast(torch.nn.utils.parameters_to_vector(model.parameters()).detach(), src=1)
    return {"role": "trainer"}


def main(out: Path) -> None:
    world = TorchCollective().setup(backend="gloo")
    world.create_group()
    rank = world.rank
    seen = check_world(world) | check_pair(rank)
    player_trainer = TorchCollective().create_group(ranks=[0, 1])
    optimization_pg = world.new_group(ranks=list(range(1, world.world_size)))
    seen |= decoupled(world, player_trainer, optimization_pg)
    world.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    groups = len(torch.distributed.distributed_c10d._pg_map)
    player_trainer.teardown()  # its members destroy the group; the others hold none
    after = {"groups_destroyed": groups - len(torch.distributed.distributed_c10d._pg_map)}
    world.teardown()
    after["owns_group"] = world._group is not None
    (out / f"rank{rank}.after.json").write_text(json.dumps(after))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
