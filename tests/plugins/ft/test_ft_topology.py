"""fabric-ft's replica groups as the fault-tolerant axis of the topology (issue 37): one answer to "which replica am
I" for the sampler, ``is_global_zero`` and ``fabric.topology``."""

from __future__ import annotations

from fabric_core import Fabric


def test_fabric_ft_answers_which_replica_am_i_once():
    """The sampler's share, ``is_global_zero`` and the topology of ``ft_ddp`` are one axis (no lighthouse is
    needed to read them: they are what the strategy is configured with until its first quorum)."""
    from fabric_ft import FTDDPStrategy

    strategy = FTDDPStrategy(lighthouse="http://127.0.0.1:1", replica_group=2, num_replica_groups=3)
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    axis = fabric.topology.axis("replica_group")
    assert axis is not None and axis.fault_tolerant and (axis.size, axis.coordinate) == (3, 2)
    assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 2}
    assert fabric.is_global_zero is False
    zero = Fabric(accelerator="cpu", strategy=FTDDPStrategy(lighthouse="http://127.0.0.1:1", replica_group=0, num_replica_groups=3))
    assert zero.is_global_zero is True
