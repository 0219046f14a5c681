"""``strategy="ft_ddp"``: data parallelism over replica groups that keeps training when a group dies (torchft).

Every replica group is a job of its own (here: one process, one device) started with the lighthouse's address and
its group number. torchft's ``Manager`` asks the lighthouse for a quorum at every step; gradients are averaged over
the groups in the quorum through torchft's fault-tolerant process group; a step whose allreduce failed (a peer
died mid-step) is not applied anywhere (``should_commit``), and the next step runs with the smaller quorum. A
restarted group asks for a quorum, sees it is behind, and copies the live state (every model and optimizer given to
``fabric.setup``, and the step counter) from a peer before it takes part again: no checkpoint is read.

The Fabric loop is unchanged, with one rule torchft needs: ``optimizer.zero_grad()`` at the start of each step
(it starts the step's quorum) and ``optimizer.step()`` at the end (it commits or drops the step).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.environments import env_int
from fabric_core.strategies import DATA_REPLICATE, Axis, Binding, SingleDeviceStrategy
from fabric_core.utilities import count_step_as, fabric_log

if TYPE_CHECKING:
    from fabric_core.accelerators import Accelerator
    from fabric_core.io import CheckpointIO
    from fabric_core.precision import Precision

#: torchft's own variable for the lighthouse address (``http://host:port``), also read by its Manager.
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
#: Which replica group this process belongs to, and how many there are (the names torchft's examples use).
REPLICA_GROUP_VARIABLE = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_VARIABLE = "NUM_REPLICA_GROUPS"


_NO_QUORUM_YET = object()


def _optimizer_wrapper(manager: Any, optimizer: Optimizer) -> Optimizer:
    from torchft.optim import OptimizerWrapper

    class FTOptimizer(OptimizerWrapper):
        """torchft's wrapper: ``zero_grad`` starts the step's quorum, ``step`` applies the update only when every
        replica group of the quorum agrees the step is good; ``committed`` says what the last step did."""

        committed: bool | None = None

        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise ValueError("`ft_ddp` cannot step an optimizer with a closure (torchft commits a whole step).")
            self.committed = bool(self.manager.should_commit())
            if self.committed:
                self.optim.step()

    return FTOptimizer(manager, optimizer)


def _ddp_class() -> type:
    from torchft import DistributedDataParallel
    from torchft.manager import _ManagedFuture

    class FTDistributedDataParallel(DistributedDataParallel):
        """torchft's DDP with a comm hook that survives a step already failed.

        Once the manager has seen an error in a step (a peer died, the group could not be reconfigured), its
        ``allreduce`` returns a finished dummy work whose future is a plain one; torchft 0.2.0's hook (and its main
        branch at 73dafea) asserts the managed future's inner one exists and fails the backward pass with an
        ``AssertionError``, killing the survivor. Here the bucket is handed back unreduced instead: the step is
        dropped by ``should_commit`` anyway.
        """

        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks real annotations; ours are strings
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", None) if isinstance(future, _ManagedFuture) else future
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    return FTDistributedDataParallel


class FTDDPStrategy(SingleDeviceStrategy):
    """One process per replica group; gradients averaged over the live replica groups by torchft.

    Args:
        lighthouse: the lighthouse's address, ``http://host:port``; default ``$TORCHFT_LIGHTHOUSE``.
        replica_group: this process's group, ``0 <= replica_group < num_replica_groups``; default
            ``$REPLICA_GROUP_ID``.
        num_replica_groups: how many groups the job has (the data is split into this many shares); default
            ``$NUM_REPLICA_GROUPS``.
        min_replicas: a step is committed only when at least this many groups took part (1: one survivor goes on).
        hostname: the address the other groups reach this one at (its manager and checkpoint server); default
            this machine's hostname. Use ``127.0.0.1`` when every group runs on this machine.
        timeout: how long a collective, a commit vote or a state transfer may take before the step is dropped.
        quorum_timeout: how long a step waits for its quorum (the lighthouse waits up to its ``join_timeout_ms``
            for groups that were in the previous quorum).
        connect_timeout: how long connecting to the lighthouse and to the peers may take.
    """

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_group: int | None = None,
        num_replica_groups: int | None = None,
        min_replicas: int = 1,
        hostname: str | None = None,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=30),
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE) or None
        self.replica_group = replica_group if replica_group is not None else env_int(REPLICA_GROUP_VARIABLE, None)
        self.num_replica_groups = (
            num_replica_groups if num_replica_groups is not None else env_int(NUM_REPLICA_GROUPS_VARIABLE, None)
        )
        if min_replicas < 1:
            raise ValueError(f"`min_replicas={min_replicas}` must be at least 1.")
        self.min_replicas = min_replicas
        self.hostname = hostname or socket.gethostname()
        self.timeout = timeout
        self.quorum_timeout = quorum_timeout
        self.connect_timeout = connect_timeout
        self._manager: Any = None
        self._store: Any = None
        self._states = 0
        self._participants: int | None = None
        self._quorum_rank: Any = _NO_QUORUM_YET  # this group's rank in the last step's quorum (None: healing)

    def _check_configuration(self) -> None:
        missing = []
        if not self.lighthouse:
            missing.append(f"the lighthouse address (`lighthouse=` or ${LIGHTHOUSE_VARIABLE}, e.g. http://host:29510)")
        if self.replica_group is None:
            missing.append(f"this process's replica group (`replica_group=` or ${REPLICA_GROUP_VARIABLE})")
        if self.num_replica_groups is None:
            missing.append(f"the number of replica groups (`num_replica_groups=` or ${NUM_REPLICA_GROUPS_VARIABLE})")
        if missing:
            raise ValueError(
                "`strategy='ft_ddp'` needs " + "; ".join(missing) + ". Start a lighthouse"
                " (`torchft_lighthouse --bind 0.0.0.0:29510 --min_replicas 1`) and one job per replica group; see"
                " plugins/ft/README.md."
            )
        assert self.replica_group is not None and self.num_replica_groups is not None
        if self.num_replica_groups < 1 or not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(
                f"The replica group must be between 0 and num_replica_groups - 1, got replica_group="
                f"{self.replica_group} with num_replica_groups={self.num_replica_groups}."
            )

    def attach(self, binding: Binding) -> None:
        num_nodes, devices = binding.num_nodes, binding.devices
        if num_nodes > 1:
            raise ValueError(
                "`strategy='ft_ddp'` runs one process per replica group, and `num_nodes` is per group. Start one job"
                " per machine with its own $REPLICA_GROUP_ID instead of `num_nodes>1`."
            )
        if len(devices) > 1:
            raise ValueError(
                f"`strategy='ft_ddp'` runs one process per replica group, but `devices` selects {len(devices)}. Use"
                f" `devices=1` and start {len(devices)} replica groups (one job each) to use {len(devices)} devices."
            )
        super().attach(binding)
        self._check_configuration()

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_manager()

    def _start_manager(self) -> Any:
        """The group's store (torchft's manager reads its peers' addresses through it), the fault-tolerant process
        group and the manager, which registers with the lighthouse. At ``fabric.launch()``, or at the first
        ``fabric.setup`` of a script that does not launch (one process needs no launcher)."""
        if self._manager is not None:
            return self._manager
        self._check_configuration()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        if self.root_device.type == "cuda":
            from torchft.process_group import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=self.timeout)
        else:
            pg = ProcessGroupGloo(timeout=self.timeout)
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replicas,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.connect_timeout,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse,
            # torchft derives a global rank from the trailing digits of the replica id.
            replica_id=f"fabric_ft_{self.replica_group}",
            hostname=self.hostname,
        )
        fabric_log.info(
            f"fabric-ft: replica group {self.replica_group} of {self.num_replica_groups} registered with the"
            f" lighthouse {self.lighthouse}"
        )
        return self._manager

    def teardown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        self._store = None
        super().teardown()

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this process (``current_step()``, ``num_participants()``, ...)."""
        return self._start_manager()

    # ---------------------------------------------------------------------------------------- ranks and data
    def parallel_axes(self) -> tuple[Axis, ...]:
        """One fault-tolerant axis, ``replica_group``: ``num_replica_groups`` groups, this one ``replica_group``;
        live, the groups of the last step's quorum and this group's rank in it (before the first quorum: every
        group; while this group heals: not taking part).

        The one answer to "which replica am I": the sampler's fixed share is the configured coordinate (see
        plugins/ft/README.md for what a failure does to the shares), and ``is_global_zero`` (who logs and writes
        the checkpoints of ``fabric.save``) is the first group of the current quorum, so they go on when group 0 is
        down.
        """
        if self.num_replica_groups is None or self.replica_group is None:
            return ()
        if self._quorum_rank is _NO_QUORUM_YET:
            live: dict[str, Any] = {}
        else:
            live = {"live_size": self._participants, "live_coordinate": self._quorum_rank}
        return (
            Axis("replica_group", self.num_replica_groups, self.replica_group, DATA_REPLICATE, fault_tolerant=True, **live),
        )

    # ---------------------------------------------------------------------------------------- setup
    def setup_module(self, module: Module) -> Module:
        self._register_state(f"module_{self._states}", module.state_dict, module.load_state_dict)
        return _ddp_class()(self.manager, module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._register_state(f"optimizer_{self._states}", optimizer.state_dict, optimizer.load_state_dict)
        return _optimizer_wrapper(self.manager, optimizer)

    def _register_state(self, key: str, state_dict: Any, load_state_dict: Any) -> None:
        """What a rejoining group receives from a live peer: everything given to ``fabric.setup``."""
        self._states += 1
        self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def unwrap_module(self, module: Module) -> Module:
        from torchft import DistributedDataParallel

        return module.module if isinstance(module, DistributedDataParallel) else module

    # ---------------------------------------------------------------------------------------- training step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step (committed or dropped by torchft), then note this group's place in the quorum and log a change of
        the quorum's size."""
        result = super().optimizer_step(optimizer, **kwargs)
        self._quorum_rank = self.manager.participating_rank()
        participants = self.manager.num_participants()
        if participants != self._participants or getattr(optimizer, "committed", True) is False:
            # the goodput ledger: a step the quorum dropped, or the one that changed it, is time lost to the quorum
            count_step_as("quorum")
        if participants != self._participants:
            fabric_log.info(
                f"fabric-ft: replica group {self.replica_group}: {participants} replica group(s) in the quorum at"
                f" step {self.manager.current_step()}"
            )
            self._participants = participants
        return result

    def __repr__(self) -> str:
        return (
            f"FTDDPStrategy(replica_group={self.replica_group}, num_replica_groups={self.num_replica_groups},"
            f" lighthouse={self.lighthouse!r})"
        )
