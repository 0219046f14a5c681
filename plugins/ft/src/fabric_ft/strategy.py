"""Fault tolerance as an axis: replica groups coordinated by torchft around whatever strategy runs inside each group.

A job is ``num_replica_groups`` replica groups, each started on its own (one ``fabric run`` or ``python train.py``
each, or all of them by ``fabric run --launcher ft``), and a lighthouse that forms a quorum of the live groups. Inside
a group the strategy is an ordinary one (one process; ``fsdp`` over the group's processes, which makes HSDP; ``ddp``
over them); across groups torchft averages what that strategy produced (:mod:`fabric_ft.gradients`), or synchronises
every ``sync_every`` steps (:mod:`fabric_ft.semi_sync`). The topology gets one more axis, ``replica_group``, outermost,
fault-tolerant: its configured size and this group's number, and live, the quorum's size and this group's place in
it.

When a group loses a process, the group's launcher ends the whole group (the others of it would wait forever in the
group's collectives), the lighthouse forms the next quorum without it, and the others go on at their next step. A
restarted group asks for a quorum, sees it is behind, and copies the live state from a peer before it takes part:
every model and optimizer given to ``fabric.setup`` (each process its own shard, :mod:`fabric_ft.state`), torchft's
step counter, and the data position (:mod:`fabric_ft.data`). No checkpoint is read and no other group restarts.

:class:`FaultTolerant` composes with the strategy inside by name: ``FaultTolerant("fsdp", ...)`` is an instance of a
class made once from ``FaultTolerant`` and the class registered as ``fsdp`` (this plugin never imports another
plugin; the registry hands it the class). ``ft_ddp`` (one process per group) is :class:`FTDDPStrategy`, the same
composition over the core's single-device strategy.
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
from fabric_core.strategies import DATA_REPLICATE, Axis, Binding, SingleDeviceStrategy, Strategy
from fabric_core.utilities import count_step_as, fabric_log
from fabric_ft import gradients, semi_sync, state
from fabric_ft.data import ReplicatedPosition
from fabric_ft.variables import (
    HOSTNAME_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    NUM_REPLICA_GROUPS_VARIABLE,
    REPLICA_GROUP_VARIABLE,
)

if TYPE_CHECKING:
    from fabric_core.accelerators import Accelerator
    from fabric_core.io import CheckpointHandle, CheckpointIO
    from fabric_core.precision import Precision

#: The name of the fault-tolerant axis in the topology.
AXIS_NAME = "replica_group"

__all__ = ["FTDDPStrategy", "FaultTolerant"]

_NO_QUORUM_YET = object()


def _inner_class(strategy: str | type) -> tuple[type, dict[str, Any], str]:
    """The class of the strategy inside each group, the keyword arguments its registered name adds, and a label."""
    if isinstance(strategy, type):
        if not issubclass(strategy, Strategy):
            raise TypeError(
                f"`FaultTolerant(strategy=...)` takes a strategy name or class, got {strategy!r}."
            )
        return strategy, {}, strategy.__name__
    if not isinstance(strategy, str):
        raise TypeError(
            f"`FaultTolerant(strategy=...)` takes a registered strategy name ('fsdp', 'ddp') or a `Strategy` class, got"
            f" {type(strategy).__name__}. Pass the strategy's arguments to `FaultTolerant` itself:"
            " `FaultTolerant('fsdp', reshard_after_forward=False)`."
        )
    from fabric_core.plugins import get_registry

    registry = get_registry()
    entry = registry.lookup("strategy", strategy.lower())
    if entry is None:
        raise ValueError(registry.unknown_name_message("strategy", strategy))
    cls = entry.load()
    if issubclass(cls, FaultTolerant):
        raise ValueError(
            f"`FaultTolerant({strategy!r})`: {strategy!r} is fault-tolerant already; name the strategy inside."
        )
    return cls, dict(entry.init_kwargs), entry.name


_COMPOSED: dict[type, type] = {}


def _composed(inner: type) -> type:
    """``FaultTolerant`` over ``inner``, made once per class (``isinstance(s, FSDPStrategy)`` stays true)."""
    cls = _COMPOSED.get(inner)
    if cls is None:
        cls = type(f"FaultTolerant{inner.__name__}", (FaultTolerant, inner), {"__module__": __name__})
        _COMPOSED[inner] = cls
    return cls


def _rebuild(inner: type, state_: dict[str, Any]) -> Any:
    obj = object.__new__(_composed(inner))
    obj.__dict__.update(state_)
    return obj


class FaultTolerant(Strategy):
    """Replica groups that keep training when one dies, each running ``strategy`` inside (torchft across them).

    ``FaultTolerant("fsdp")`` is HSDP whose replicas come and go (registered as ``ft_fsdp``); ``FaultTolerant("ddp",
    find_unused_parameters=True)`` runs DDP inside each group; :class:`FTDDPStrategy` (``ft_ddp``) one process per
    group. The object is an instance of the strategy inside too (``isinstance(s, FSDPStrategy)``).

    Args:
        strategy: the strategy inside each replica group: a registered name (``"fsdp"``, ``"ddp"``) or a class.
        lighthouse: the lighthouse's address, ``http://host:port``; default ``$TORCHFT_LIGHTHOUSE``.
        replica_group: this job's group, ``0 <= replica_group < num_replica_groups``; default ``$REPLICA_GROUP_ID``.
        num_replica_groups: how many groups the job has; default ``$NUM_REPLICA_GROUPS``.
        min_replicas: a step (or a synchronisation) is committed only when at least this many groups took part.
        hostname: the address the other groups reach this one at (its manager, checkpoint server and store);
            default this machine's hostname. ``127.0.0.1`` when every group runs on this machine.
        timeout: how long a collective across groups, a commit vote or a state transfer may take before the step is
            dropped (``replica_timeout`` on the strategy). The collectives inside a group (FSDP's) keep the inner
            strategy's own timeout (``FABRIC_TIMEOUT``, else 30 minutes): a process of a group may wait inside its
            group while a peer waits for the step's quorum, which can take ``quorum_timeout``.
        quorum_timeout: how long a step waits for its quorum (semi-synchronous: a synchronisation; the lighthouse
            waits up to its ``join_timeout_ms`` for groups of the previous quorum). Semi-synchronous training
            defaults to 30 minutes: a restarted group waits for the others' next synchronisation.
        connect_timeout: how long connecting to the lighthouse and to the peers may take.
        semi_sync: ``None`` (every step synchronous: gradients averaged across groups), ``"local_sgd"`` (weights
            averaged every ``sync_every`` steps) or ``"diloco"`` (pseudo-gradients averaged and an outer optimizer
            stepped every ``sync_every`` steps).
        sync_every: the steps between two synchronisations (semi-synchronous only).
        outer_optimizer: DiLoCo's outer optimizer, ``fn(parameters) -> Optimizer`` (default: Nesterov SGD, lr 0.7,
            momentum 0.9).
        **strategy_kwargs: the arguments of the strategy inside (``reshard_after_forward=``, ``precision=``, ...).
    """

    #: One process per replica group (``ft_ddp``): ``devices>1`` and ``num_nodes>1`` are refused.
    one_process_per_group = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not FaultTolerant:
            return super().__new__(cls)
        inner, _, _ = _inner_class(args[0] if args else kwargs.get("strategy", "ddp"))
        return super().__new__(_composed(inner))

    def __init__(
        self,
        strategy: str | type | None = "ddp",
        *,
        lighthouse: str | None = None,
        replica_group: int | None = None,
        num_replica_groups: int | None = None,
        min_replicas: int = 1,
        hostname: str | None = None,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta | None = None,
        connect_timeout: timedelta = timedelta(seconds=30),
        semi_sync: str | None = None,
        sync_every: int | None = None,
        outer_optimizer: Any = None,
        **strategy_kwargs: Any,
    ) -> None:
        if strategy is not None:
            _, registered, label = _inner_class(strategy)
            strategy_kwargs = {**registered, **strategy_kwargs}
        else:
            label = "one process"
        super().__init__(**strategy_kwargs)
        self.inner_strategy = label
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE) or None
        self.replica_group = (
            replica_group if replica_group is not None else env_int(REPLICA_GROUP_VARIABLE, None)
        )
        self.num_replica_groups = (
            num_replica_groups
            if num_replica_groups is not None
            else env_int(NUM_REPLICA_GROUPS_VARIABLE, None)
        )
        if min_replicas < 1:
            raise ValueError(f"`min_replicas={min_replicas}` must be at least 1.")
        self.min_replicas = min_replicas
        self.hostname = hostname or os.environ.get(HOSTNAME_VARIABLE) or socket.gethostname()
        if semi_sync is not None and semi_sync not in semi_sync_methods():
            raise ValueError(f"`semi_sync={semi_sync!r}` must be None or one of {semi_sync_methods()}.")
        if semi_sync is None and (sync_every is not None or outer_optimizer is not None):
            raise ValueError(
                "`sync_every` and `outer_optimizer` belong to semi-synchronous training: pass `semi_sync='local_sgd'`"
                " or `semi_sync='diloco'` too (without it every step is synchronous)."
            )
        if semi_sync is not None:
            if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
                raise ValueError(
                    f"`semi_sync={semi_sync!r}` needs `sync_every`, a positive number of steps, got {sync_every!r}."
                )
            if outer_optimizer is not None and semi_sync != "diloco":
                raise ValueError(
                    "`outer_optimizer` is DiLoCo's: it has no meaning for `semi_sync='local_sgd'`."
                )
        self.semi_sync = semi_sync
        self.sync_every = sync_every
        self.outer_optimizer = outer_optimizer
        self.replica_timeout = timeout  # not `self.timeout`: that is the inner strategy's, for its own group
        if quorum_timeout is None:
            quorum_timeout = timedelta(minutes=30) if semi_sync is not None else timedelta(seconds=60)
        self.quorum_timeout = quorum_timeout
        self.connect_timeout = connect_timeout
        self._manager: Any = None
        self._pg: Any = None
        self._store: Any = None
        self._states = 0
        self._participants: int | None = None
        self._quorum_rank: Any = _NO_QUORUM_YET  # this group's rank in the last quorum (None: healing)
        self._quorum_changes = 0
        self._semi_sync_algorithm: Any = None
        self._modules: list[Module] = []
        self.data = ReplicatedPosition(self)

    def __reduce__(self) -> Any:
        cls = type(self)
        if cls in _COMPOSED.values():
            inner = next(
                base
                for base in cls.__mro__[1:]
                if base is not FaultTolerant and not issubclass(base, FaultTolerant)
            )
            return _rebuild, (inner, self.__dict__)
        return object.__reduce_ex__(self, 2)

    # ---------------------------------------------------------------------------------------- configuration
    def _check_configuration(self) -> None:
        missing = []
        if not self.lighthouse:
            missing.append(
                f"the lighthouse address (`lighthouse=` or ${LIGHTHOUSE_VARIABLE}, e.g. http://host:29510)"
            )
        if self.replica_group is None:
            missing.append(f"this process's replica group (`replica_group=` or ${REPLICA_GROUP_VARIABLE})")
        if self.num_replica_groups is None:
            missing.append(
                f"the number of replica groups (`num_replica_groups=` or ${NUM_REPLICA_GROUPS_VARIABLE})"
            )
        if missing:
            raise ValueError(
                f"`strategy={self._name()!r}` needs "
                + "; ".join(missing)
                + ". Start a lighthouse and one job per"
                " replica group (`fabric run --launcher ft --ft-groups N ...` does both on one machine), or set them"
                " yourself; see plugins/ft/README.md."
            )
        assert self.replica_group is not None and self.num_replica_groups is not None
        if self.num_replica_groups < 1 or not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(
                f"The replica group must be between 0 and num_replica_groups - 1, got replica_group="
                f"{self.replica_group} with num_replica_groups={self.num_replica_groups}."
            )

    def _name(self) -> str:
        return "ft_ddp" if self.one_process_per_group else f"FaultTolerant({self.inner_strategy!r})"

    def attach(self, binding: Binding) -> None:
        if self.one_process_per_group:
            if binding.num_nodes > 1:
                raise ValueError(
                    "`strategy='ft_ddp'` runs one process per replica group, and `num_nodes` is per group. Start one"
                    " job per machine with its own $REPLICA_GROUP_ID, or run several processes per group with"
                    " `FaultTolerant('fsdp')` (HSDP)."
                )
            if len(binding.devices) > 1:
                n = len(binding.devices)
                raise ValueError(
                    f"`strategy='ft_ddp'` runs one process per replica group, but `devices` selects {n}. Use"
                    f" `devices=1` and start {n} replica groups, or run {n} processes per group with"
                    " `strategy='ft_fsdp'` (HSDP) or `FaultTolerant('ddp', find_unused_parameters=True)`."
                )
        super().attach(binding)
        self._check_configuration()

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_manager()

    def _start_manager(self) -> Any:
        """The group's store (torchft's manager finds the group's manager server through it, and other groups meet
        this one's processes there), the fault-tolerant process group and the manager, which registers with the
        lighthouse. At ``fabric.launch()``/``fabric run``, or at the first ``fabric.setup`` of a one-process group
        that was not launched."""
        if self._manager is not None:
            return self._manager
        self._check_configuration()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        rank, world = self.global_rank, self.world_size
        if self.root_device.type == "cuda":
            from torchft.process_group import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=self.replica_timeout)
        else:
            pg = ProcessGroupGloo(timeout=self.replica_timeout)
        # A fresh store per start of the group (a restarted group must not read its previous manager's address from a
        # store that outlived it), hosted by the group's first process where every group can reach it.
        if rank == 0:
            self._store = TCPStore(self.hostname, 0, is_master=True, wait_for_workers=False)
        port = self._store.port if rank == 0 else None
        if world > 1:
            port = self.broadcast(port, src=0)
        self._pg = pg
        self._manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replicas,
            use_async_quorum=self.semi_sync is None,
            timeout=self.replica_timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.connect_timeout,
            rank=rank,
            world_size=world,
            store_addr=self.hostname,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            # torchft derives a global rank from the trailing digits of the replica id.
            replica_id=f"fabric_ft_{self.replica_group}",
            hostname=self.hostname,
        )
        self.data.register(self._manager)
        fabric_log.info(
            f"fabric-ft: replica group {self.replica_group} of {self.num_replica_groups} ({self.inner_strategy} inside,"
            f" process {rank} of {world}) registered with the lighthouse {self.lighthouse}"
        )
        return self._manager

    def teardown(self) -> None:
        if self._semi_sync_algorithm is not None:
            self._semi_sync_algorithm.__exit__(None, None, None)
            self._semi_sync_algorithm = None
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        self._store = None
        super().teardown()

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this process (``current_step()``, ``num_participants()``, ...)."""
        return self._start_manager()

    # ---------------------------------------------------------------------------------------- topology
    def parallel_axes(self) -> tuple[Axis, ...]:
        """``replica_group`` (fault-tolerant, outermost), then the axes of the strategy inside the group.

        Configured: ``num_replica_groups`` groups, this one ``replica_group``; live: the groups of the last quorum
        and this group's rank in it (before the first quorum: every group; while this group heals: not taking part).
        ``is_global_zero`` (who writes what one process writes) is the first process of the first live group, so it
        moves on when group 0 is down.
        """
        inner = super().parallel_axes()
        if self.num_replica_groups is None or self.replica_group is None:
            return inner
        if self._quorum_rank is _NO_QUORUM_YET:
            live: dict[str, Any] = {}
        else:
            live = {"live_size": self._participants, "live_coordinate": self._quorum_rank}
        axis = Axis(
            AXIS_NAME,
            self.num_replica_groups,
            self.replica_group,
            DATA_REPLICATE,
            fault_tolerant=True,
            **live,
        )
        return (axis, *inner)

    # ---------------------------------------------------------------------------------------- setup
    def setup_module(self, module: Module) -> Module:
        """The strategy inside sets the module up (shards it, wraps it), then its gradients are averaged across
        groups too (synchronous) and its state is what a restarted group receives."""
        manager = self.manager
        module = super().setup_module(module)
        plain = self.unwrap_module(module)
        self._modules.append(plain)
        if (
            self.semi_sync != "diloco"
        ):  # DiLoCo's rejoining group takes the synchronised weights (see setup_optimizer)
            self._register_state(f"module_{self._states}", *state.module_state(plain))
        if self.semi_sync is None:
            module = gradients.average_across_groups(manager, module, plain)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        self._register_state(f"optimizer_{self._states}", *state.optimizer_state(optimizer))
        if self.semi_sync is None:
            return _optimizer_wrapper(self.manager, optimizer, self)
        if self._semi_sync_algorithm is not None or len(self._modules) != 1:
            raise ValueError(
                f"`semi_sync={self.semi_sync!r}` synchronises one model trained by one optimizer: set up exactly one"
                " model and one optimizer with this Fabric."
            )
        module = self._modules[0]
        assert self.semi_sync is not None and self.sync_every is not None
        self._semi_sync_algorithm = semi_sync.build(
            self.semi_sync, self.manager, module, optimizer, self.sync_every, self.outer_optimizer
        )
        if self.semi_sync == "diloco":
            # After DiLoCo's own state (the synchronised weights, the outer optimizer): a rejoining group's model is
            # the synchronised weights, so it brings nothing of its own to the synchronisation it joins at.
            self._register_state(
                f"module_{self._states}", *_synchronised_weights(self._semi_sync_algorithm, module)
            )
        semi_sync.join_at_next_sync(self._semi_sync_algorithm, self.sync_every)
        return optimizer

    def _register_state(self, key: str, load: Any, save: Any) -> None:
        """What a rejoining group receives from a live peer: everything given to ``fabric.setup``."""
        self._states += 1
        self.manager.register_state_dict_fn(key, load, save)

    def unwrap_module(self, module: Module) -> Module:
        from torchft import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):  # torchft's, around a one-process group's module
            return module.module
        return super().unwrap_module(module)

    # ---------------------------------------------------------------------------------------- training step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step (synchronous: committed or dropped by torchft; semi-synchronous: the inner step, and at a
        synchronisation its outcome), then note this group's place in the quorum and what the step did to the data
        position (:mod:`fabric_ft.data`)."""
        algorithm = self._semi_sync_algorithm
        if algorithm is None:
            result = super().optimizer_step(optimizer, **kwargs)
            self._note_quorum(committed=getattr(optimizer, "committed", True) is not False)
            return result
        manager = self.manager
        before = manager.current_step()
        result = super().optimizer_step(optimizer, **kwargs)
        first = before == 0
        synchronised = algorithm._local_step == 0  # torchft 0.2.0: LocalSGD and DiLoCo count inner steps there
        if synchronised:
            committed = manager.current_step() > before
            self._note_quorum(committed)
            healed = any(cursor.received is not None for cursor in self.data.cursors)
            self.data.after_inner_step(True, committed, healed, manager.num_participants(), first=first)
        else:
            self.data.after_inner_step(False, False, False, 0)
        return result

    def quorum_size(self) -> int:
        """The replica groups in the current quorum, those that heal in it included (the fault-tolerant process group's
        size); 0 when it could not be configured."""
        return self.quorum_place()[1]

    def quorum_place(self) -> tuple[int, int]:
        """This group's rank among every group of the current quorum (those that heal in it included) and their
        number: the fault-tolerant process group's rank and size; ``(0, 0)`` when it could not be configured."""
        try:
            return int(self._pg.parent.rank()), int(self._pg.size())
        except (AssertionError, RuntimeError):  # not configured: the step fails anyway
            return 0, 0

    def data_cursor(self) -> Any:
        """Each loader's position as the replica groups committed it (:mod:`fabric_ft.data`)."""
        return self.data.cursor()

    def samples_trained(self) -> Any:
        """Whether the last step trained its batches (for the sample ledger; see :mod:`fabric_ft.data`)."""
        return self.data.verdict

    def _note_quorum(self, committed: bool = True) -> None:
        manager = self.manager
        if manager._quorum_future is None:  # no quorum asked yet (semi-synchronous, before the first synchronisation)
            return
        self._quorum_rank = manager.participating_rank()
        self.data.note_quorum(*self.quorum_place())
        participants = manager.num_participants()
        if participants != self._participants or not committed:
            # the goodput ledger: a step the quorum dropped, or the one that changed it, is time lost to the quorum
            count_step_as("quorum")
        if participants != self._participants:
            if self._participants is not None:
                self._quorum_changes += 1
            fabric_log.info(
                f"fabric-ft: replica group {self.replica_group}: {participants} replica group(s) in the quorum at"
                f" step {manager.current_step()}"
            )
            self._participants = participants

    def metrics(self) -> dict[str, float]:
        """Logged beside the user's metrics at every ``fabric.log``: ``ft/quorum_size`` (replica groups in the last
        quorum), ``ft/quorum_changes`` (how often it changed), ``ft/step`` (torchft's committed steps),
        ``ft/steps_dropped`` and ``ft/samples_requeued`` (steps not committed and their samples queued again)."""
        return {
            "ft/quorum_size": float(self._participants or 0),
            "ft/quorum_changes": float(self._quorum_changes),
            "ft/step": float(self._manager.current_step() if self._manager is not None else 0),  # starts nothing
            "ft/steps_dropped": float(self.data.steps_dropped),
            "ft/samples_requeued": float(self.data.samples_requeued),
        }

    # ---------------------------------------------------------------------------------------- checkpoints
    def _writes_checkpoints(self) -> bool:
        """Whether this group writes ``fabric.save``'s checkpoints: the first group of the last quorum does (every
        group holds the same state; several writing one path would collide); group 0 before any quorum."""
        if self._quorum_rank is _NO_QUORUM_YET:
            return self.replica_group == 0
        return self._quorum_rank == 0

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None, **kwargs: Any
    ) -> None:
        if self._writes_checkpoints():
            super().save_checkpoint(path, state, storage_options, filter, **kwargs)

    def save_checkpoint_async(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None, **kwargs: Any
    ) -> CheckpointHandle:
        if self._writes_checkpoints():
            return super().save_checkpoint_async(path, state, storage_options, filter, **kwargs)
        from concurrent.futures import Future

        from fabric_core.io import CheckpointHandle

        done: Future = Future()
        done.set_result(None)
        return CheckpointHandle(str(path), done)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replica_group={self.replica_group}, num_replica_groups={self.num_replica_groups},"
            f" lighthouse={self.lighthouse!r}, semi_sync={self.semi_sync!r})"
        )


def semi_sync_methods() -> tuple[str, ...]:
    return semi_sync.METHODS


def _synchronised_weights(algorithm: Any, module: Module) -> tuple[Any, Any]:
    """DiLoCo's module state for a rejoining group: nothing is sent (the peer's synchronised weights come with
    DiLoCo's own state, registered before this); on arrival they are copied into the model."""
    fragment = algorithm._fragments[0]  # torchft 0.2.0: one fragment per model given

    def load(_: Any) -> None:
        fragment.restore_parameters()

    def save() -> dict[str, Any]:
        return {}

    return load, save


class FTDDPStrategy(FaultTolerant, SingleDeviceStrategy):
    """``ft_ddp``: one process per replica group; gradients averaged over the live groups by torchft.

    Takes :class:`FaultTolerant`'s arguments (``lighthouse``, ``replica_group``, ``semi_sync``, ...) and the
    single-device strategy's (``device``, ``accelerator``, ``checkpoint_io``, ``precision``). Needs no
    ``fabric.launch()``: the group's one process is the process that runs the script.
    """

    one_process_per_group = True

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_group: int | None = None,
        num_replica_groups: int | None = None,
        min_replicas: int = 1,
        hostname: str | None = None,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta | None = None,
        connect_timeout: timedelta = timedelta(seconds=30),
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        *,
        semi_sync: str | None = None,
        sync_every: int | None = None,
        outer_optimizer: Any = None,
    ) -> None:
        super().__init__(
            None,
            lighthouse=lighthouse,
            replica_group=replica_group,
            num_replica_groups=num_replica_groups,
            min_replicas=min_replicas,
            hostname=hostname,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            semi_sync=semi_sync,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )

    def setup_module(self, module: Module) -> Module:
        self._start_manager()  # a one-process script that does not launch starts it at its first setup
        return super().setup_module(module)


def _optimizer_wrapper(manager: Any, optimizer: Optimizer, strategy: FaultTolerant) -> Optimizer:
    from torchft.optim import OptimizerWrapper

    class FTOptimizer(OptimizerWrapper):
        """torchft's wrapper: ``zero_grad`` starts the step's quorum, ``step`` applies the update only when every
        replica group of the quorum agrees the step is good; ``committed`` says what the last step did."""

        committed: bool | None = None

        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise ValueError(
                    "`ft_ddp` cannot step an optimizer with a closure (torchft commits a whole step)."
                )
            self.manager.wait_quorum()
            healing = not self.manager.is_participating()  # torchft zeroed this group's gradients: it receives the state
            # torchft's first step of a job synchronises the weights (init_sync): every group but one receives the
            # first one's, with their own gradients zeroed. Nothing is trained in it; its batches are drawn again.
            first = self.manager.current_step() == 0
            if not first:  # the first step trains nothing whatever its data; it must commit for the step to move on
                strategy.data.before_commit(self.manager, strategy.quorum_size())
            committed = bool(self.manager.should_commit())
            self.committed = committed and not first
            if self.committed:
                self.optim.step()
            strategy.data.after_commit(committed, healed=healing, trained=not first)

    return FTOptimizer(manager, optimizer)
