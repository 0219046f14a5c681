"""The strategy contract that every strategy plugin implements.

The facade (:class:`fabric_core.Fabric`) only ever talks to a strategy through the methods and attributes
declared here, so a new strategy never needs a change in the core. The defaults are correct for one process
holding the whole model; parallel strategies override what they must. Every attribute the core reads is
declared on this class (``launcher_name``, ``requires_launch``, ``requires_joint_setup``,
``optimizer_step_target``, ``backward_sync_control``, ...) and documented in ``docs/plugins.md``.

Checkpoints are a component of their own (:mod:`fabric_core.io`): a strategy names the format it writes
(:meth:`Strategy.checkpoint_format`) and hands formats what they need from it (:meth:`Strategy.checkpoint_context`:
how a module or an optimizer becomes a state dict and back, the coordinator, the precision's state); the walk over
the user's state, the formats and the crash-safe commit are shared by every strategy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.precision.base import Precision
from fabric_core.utilities.apply import move_data_to_device
from fabric_core.utilities.topology import DATA_REPLICATE, TENSOR, Axis, Topology

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.io.background import CheckpointHandle
    from fabric_core.io.checkpoint_io import CheckpointIO
    from fabric_core.io.coordination import Coordinator
    from fabric_core.io.format import CheckpointFormat, FormatContext
    from fabric_core.io.location import CheckpointLocation
    from fabric_core.io.registered import RegisteredFormat
    from fabric_core.io.snapshot import SnapshotBuffers
    from fabric_core.io.state import Filter
    from fabric_core.launchers.base import Launcher
    from fabric_core.strategies.forward_backward import ForwardBackward
    from fabric_core.utilities.global_order import DataCursor

__all__ = ["REDUCE_OPS", "BackwardSyncControl", "Binding", "Strategy", "check_reduce_op", "require_precision_type"]


def __getattr__(name: str) -> Any:
    # Re-exported for plugins (`from fabric_core.strategies.base import PRECISION_STATE_KEY`) without importing the
    # checkpoint modules at start-up: a run that never saves never needs them.
    if name == "PRECISION_STATE_KEY":
        from fabric_core.io.state import PRECISION_STATE_KEY

        return PRECISION_STATE_KEY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The reduction names every strategy accepts (``"avg"`` is ``"mean"``).
REDUCE_OPS = ("mean", "avg", "sum", "max", "min", "product")


def check_reduce_op(reduce_op: Any) -> str | Any:
    """The lower-cased name of a reduction, or the ``torch.distributed.ReduceOp`` given; ``ValueError`` otherwise."""
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name not in REDUCE_OPS:
            raise ValueError(f"Unsupported reduce_op {reduce_op!r}: use 'mean', 'sum', 'max', 'min' or 'product'.")
        return name
    if type(reduce_op).__name__ in ("ReduceOp", "RedOpType"):
        return reduce_op
    raise ValueError(
        f"Unsupported reduce_op {reduce_op!r} ({type(reduce_op).__name__}): use 'mean', 'sum', 'max', 'min',"
        " 'product', or a `torch.distributed.ReduceOp`."
    )


def require_precision_type(
    precision: Precision | None,
    *,
    strategy: str,
    name: str,
    needs: type[Precision],
    supported: Iterable[str],
    reason: str,
    also_accepted: tuple[type[Precision], ...] = (),
    accept_module_transforms: bool = False,
) -> None:
    """Refuse a precision object that a strategy whose engine does the casting cannot drive.

    For :meth:`Strategy.check_precision` of a strategy that owns its precision type (FSDP, DeepSpeed, or a plugin's
    float8 strategy): anything but ``needs`` (or a subclass) and the exact types in ``also_accepted`` is a
    ``TypeError`` that names the strategy (``strategy``, its label; ``name``, its registered name), the precision
    given, the type it needs, why (``reason``), and how to ask for it (``supported``: the names ``needs`` takes).
    ``None`` (nothing set yet) passes. With ``accept_module_transforms``, so does a precision whose
    :attr:`~fabric_core.precision.base.Precision.transforms_modules_only` is true (it only rewrites modules, so it
    does not compete with the strategy's own casting).
    """
    if precision is None or isinstance(precision, needs) or type(precision) in also_accepted:
        return
    if accept_module_transforms and getattr(precision, "transforms_modules_only", False):
        return
    value = getattr(precision, "precision", None)
    supported = tuple(supported)
    package = needs.__module__.split(".", 1)[0]
    hint = (
        f" Pass `{needs.__name__}({value!r})` (from {package}) or the name, `Fabric(strategy={name!r},"
        f" precision={value!r})`."
        if value in supported
        else f" Pass one of {supported} as `precision=`, or a `{needs.__name__}`."
    )
    raise TypeError(
        f"The {strategy} strategy can only work with the `{needs.__name__}` plugin, found {precision!r}. {reason}"
        + hint
    )


@dataclass(frozen=True)
class Binding:
    """Everything the resolver decided for one strategy, handed over at once by :meth:`Strategy.bind`.

    ``precision`` is final (the user's, the strategy's own, or the one :meth:`Strategy.precision_for` or the
    ``fabric_select_precision`` hook gave, already configured for the accelerator). ``select_launcher`` is the
    ``fabric_select_launcher`` decision: a launcher is built around the strategy it starts, so it is asked last,
    inside the binding step, with the strategy complete. ``registered_formats`` are the checkpoint formats the
    installed plugins registered, which the strategy asks directly whether they recognise a checkpoint its own
    formats do not (a DDP run loading an FSDP folder), so loading needs no registry.
    """

    accelerator: Accelerator
    devices: list[torch.device]
    num_nodes: int
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    precision: Precision
    select_launcher: Callable[[Strategy], Launcher | None]
    registered_formats: tuple[RegisteredFormat, ...] = ()


class BackwardSyncControl(ABC):
    """Gives ``fabric.no_backward_sync()`` its meaning for one strategy."""

    @abstractmethod
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """A context in which backward does not synchronise gradients across processes."""


class NothingToSync(BackwardSyncControl):
    """For a strategy whose backward never synchronises gradients: one process, or replicas that reduce them later
    (at ``optimizer.step()``, as XLA does). Skipping the sync is always honoured, silently; accumulation just works."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Nothing to skip: an empty context."""
        return nullcontext()


class Strategy(ABC):
    """Base class for strategy plugins."""

    #: registered launcher name that starts the processes (``None``: no launcher, run in this process).
    launcher_name: str | None = None
    #: True when model and optimizers must go through ``setup(model, optimizer)`` together.
    requires_joint_setup: bool = False
    #: True when ``launch()`` (or the CLI) must run before models/data/collectives are used.
    requires_launch: bool = False
    #: When set, ``optimizer.step()`` on a wrapped optimizer calls ``strategy.optimizer_step(target)`` with
    #: ``target = optimizer_step_target(optimizer)`` instead of the optimizer itself (an engine that owns the
    #: step, such as DeepSpeed's). ``None``: the optimizer is stepped.
    optimizer_step_target: Callable[[Optimizer], Any] | None = None
    #: The devices set on the strategy object itself (one per local process), or ``None`` for "what ``devices=``
    #: resolves to". The resolver checks them against the ``accelerator`` flag.
    parallel_devices: list[torch.device] | None = None

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        self._accelerator = accelerator
        #: The checkpoint I/O set on this strategy (by its constructor or the resolver), or ``None`` for the default.
        self.configured_checkpoint_io: CheckpointIO | None = checkpoint_io
        #: The precision set on this strategy (by its constructor or :meth:`bind`), or ``None`` so far. A plain
        #: attribute, so the per-step fast paths of the wrappers compare it without a property call; read it, and
        #: assign :attr:`precision` (before binding) to change it.
        self.check_precision(precision)
        self.configured_precision: Precision | None = precision
        self._launcher: Launcher | None = None
        self.cluster_environment: ClusterEnvironment | None = None
        self._num_nodes = 1
        #: The checkpoint formats the installed plugins registered (the binding's), asked when loading.
        self.registered_formats: tuple[RegisteredFormat, ...] = ()
        self._snapshot_buffers: SnapshotBuffers | None = None  # made by the first save (`_snapshots`)
        self._bound = False

    # ---------------------------------------------------------------------------------------- binding
    def bind(self, binding: Binding) -> None:
        """The binding step: receive what the resolver decided, all at once, and be complete on return.

        In order: :meth:`attach` (where a strategy completes itself from the binding), the precision (checked by
        :meth:`check_precision`), then the launcher that ``binding.select_launcher`` builds around the now complete
        strategy. From then on :attr:`precision` and :attr:`launcher` are read-only. ``Fabric(...)`` calls it once;
        a strategy extends :meth:`attach`, not this.
        """
        self.attach(binding)
        self.check_precision(binding.precision)
        self.configured_precision = binding.precision
        self._launcher = binding.select_launcher(self)
        self._bound = True

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has run: the strategy is complete, and its precision and launcher are read-only."""
        return self._bound

    def _refuse_after_binding(self, member: str, how: str) -> None:
        if self._bound:
            raise AttributeError(
                f"`{type(self).__name__}.{member}` is read-only once `Fabric(...)` has bound the strategy: {how}"
            )

    def attach(self, binding: Binding) -> None:
        """The first part of :meth:`bind`: take the accelerator, nodes, checkpoint I/O and registered checkpoint
        formats the resolver decided (``binding``); values the user set on the strategy itself are kept.

        A strategy that completes itself from the binding (its devices, a check against the accelerator, a mesh)
        extends this method and calls ``super().attach(binding)``; to hand its base class a different decision, it
        passes ``dataclasses.replace(binding, ...)``. The resolver does not call it on its own.
        """
        if self._accelerator is None:
            self._accelerator = binding.accelerator
        if self.configured_checkpoint_io is None:
            self.configured_checkpoint_io = binding.checkpoint_io
        self.check_checkpoint_io(self.configured_checkpoint_io)
        self._num_nodes = binding.num_nodes
        self.registered_formats = tuple(binding.registered_formats)

    @property
    def accelerator(self) -> Accelerator | None:
        """The accelerator set on the strategy, or the one the binding step gave (``None`` before that)."""
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    @property
    def precision(self) -> Precision:
        """The precision in use: the one set (constructor, assignment, :meth:`bind`) or :meth:`default_precision`.

        Assigning one (before the strategy is passed to ``Fabric``) calls :meth:`check_precision` first; once bound
        it is read-only (``AttributeError``): the models and optimizers set up were prepared for it.
        """
        if self.configured_precision is None:
            self.configured_precision = self.default_precision()
        return self.configured_precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._refuse_after_binding(
            "precision",
            f"models and optimizers were prepared for {self.configured_precision!r}. Choose the precision when the"
            f" Fabric is created: `Fabric(precision=...)`, `Fabric(plugins=[precision])`, or"
            f" `{type(self).__name__}(precision=...)` before passing the strategy to `Fabric(strategy=...)`.",
        )
        self.check_precision(precision)
        self.configured_precision = precision

    def default_precision(self) -> Precision:
        """The precision used when none was set (the core's 32-bit one); a strategy whose engine casts overrides it."""
        return Precision()

    def precision_for(self, precision: str, accelerator: Accelerator) -> Precision | None:
        """The precision object this strategy needs for the name ``precision``, or ``None`` to use the one the
        ``fabric_select_precision`` hook gives (the registered precision of that name, by default).

        Asked once, by the resolver, before :meth:`bind` (the strategy as constructed, with the resolved
        ``accelerator``) and only when neither the user nor the strategy's constructor gave a precision object. ``precision`` is canonical
        (``"bf16-mixed"``, ``"32-true"``, ...) when a registered precision knows the name, else the user's value
        lower-cased. A strategy whose engine does the casting (FSDP, DeepSpeed, XLA) returns its own type; raise
        ``ValueError`` for a name it cannot run.
        """
        return None

    def check_precision(self, precision: Precision | None) -> None:  # noqa: B027 (optional hook)
        """Refuse, with what to use instead, a precision object this strategy cannot drive (one made for another
        strategy would bypass its casting). Called whenever a precision is set: constructor, assignment, :meth:`bind`.
        Every precision is accepted by default; a strategy that owns its precision type calls
        :func:`require_precision_type`."""

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """What single-file checkpoints are written and read through: the one set, else ``TorchCheckpointIO``.
        Assigning one calls :meth:`check_checkpoint_io` first."""
        if self.configured_checkpoint_io is None:
            from fabric_core.io.checkpoint_io import TorchCheckpointIO

            self.configured_checkpoint_io = TorchCheckpointIO(durable_in_background=True)
        return self.configured_checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self.check_checkpoint_io(io)
        self.configured_checkpoint_io = io

    def check_checkpoint_io(self, io: CheckpointIO | None) -> None:  # noqa: B027 (optional hook)
        """Refuse, with what to do instead, a ``CheckpointIO`` this strategy's checkpoint format would bypass (a
        sharded format written by every rank, say). Called when one is assigned and when the resolver attaches the
        strategy. Every ``CheckpointIO`` is accepted by default."""

    @property
    def launcher(self) -> Launcher | None:
        """The launcher that starts this strategy's processes (the ``fabric_select_launcher`` decision, made last in
        :meth:`bind`), or ``None``: everything runs here. Read-only once bound (``AttributeError``)."""
        return self._launcher

    @launcher.setter
    def launcher(self, launcher: Launcher | None) -> None:
        self._refuse_after_binding(
            "launcher",
            f"the `fabric_select_launcher` hook chose {self._launcher!r}. To start the processes another way, answer"
            " that hook for this strategy from a plugin, or set the strategy's `launcher_name` to a registered"
            " launcher.",
        )
        self._launcher = launcher

    # ---------------------------------------------------------------------------------------- topology
    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the job (0 here: one process)."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank among the processes of its node."""
        return 0

    @property
    def node_rank(self) -> int:
        """The index of this process's node."""
        return 0

    @property
    def world_size(self) -> int:
        """How many processes the job has (1 here; :class:`~fabric_core.strategies.layout.ProcessPerDevice`
        counts one per device and node)."""
        return 1

    @property
    def num_nodes(self) -> int:
        """How many nodes (machines) the job runs on, as ``Fabric(num_nodes=...)`` says."""
        return self._num_nodes

    @property
    def topology(self) -> Topology:
        """Where this process sits: the placement (nodes x processes) and the named axes of :meth:`parallel_axes`.

        Made anew on every read (a fault-tolerant replica axis changes with every quorum), so read it when needed
        rather than keep it. Samplers, ``is_global_zero``, loggers, checkpoint formats and ``fabric env`` ask this
        one object; a strategy changes what it says by overriding :meth:`parallel_axes` (and, for another placement
        of processes, :attr:`placement`).
        """
        return self.placement.with_axes(*self.parallel_axes())

    @property
    def placement(self) -> Topology:
        """Where the processes are, without axes: :attr:`world_size` processes, one per node (one process here;
        :class:`~fabric_core.strategies.layout.ProcessPerDevice` places one per device)."""
        world = max(1, self.world_size)
        return Topology(num_nodes=world, processes_per_node=1, node_rank=self.global_rank)

    def parallel_axes(self) -> tuple[Axis, ...]:
        """The named axes this strategy splits its world along, outermost first (see :class:`Axis`).

        By default: nothing for one process; for several, one data-parallel axis ``"data_replicate"`` over the
        world (every process a replica, as DDP). A strategy that shards the model (FSDP: ``"data_shard"``) or
        splits it over model axes (tensor, pipeline, sequence) overrides this. A strategy written against the older
        contract, which overrides :attr:`data_parallel_rank` and :attr:`data_parallel_size` instead, gets a
        ``"data_parallel"`` axis from them and the rest of the world as one ``"model_parallel"`` tensor axis.
        """
        world = self.world_size
        if world <= 1:
            return ()
        cls = type(self)
        if cls.data_parallel_rank is Strategy.data_parallel_rank and cls.data_parallel_size is Strategy.data_parallel_size:
            return (Axis("data_replicate", world, self.global_rank, DATA_REPLICATE),)
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if size == world:
            return (Axis("data_parallel", size, rank, DATA_REPLICATE),)
        model = world // size
        return (
            Axis("data_parallel", size, rank, DATA_REPLICATE),
            Axis("model_parallel", model, self.global_rank % model, TENSOR),
        )

    @property
    def is_global_zero(self) -> bool:
        """Whether this process writes what one process writes for the job (single-file checkpoints, logs): the
        :attr:`topology`'s answer (global rank 0, in the first live member of any fault-tolerant axis)."""
        if self.global_rank != 0:
            return False  # the common answer, without building a topology
        return self.topology.is_global_zero

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this process trains on: processes with the same data-parallel rank must get the
        same batches (the tensor-parallel peers of a model sharded over several processes do).

        The :attr:`topology`'s (its coordinates over every data axis together). A strategy declares it through
        :meth:`parallel_axes`; the sampler of ``fabric.setup_dataloaders`` uses it, and ``fabric.setup`` refuses a
        model with DTensor parameters from a strategy that declares no axes (the default could give tensor-parallel
        peers different batches).
        """
        return self.topology.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into (see :attr:`data_parallel_rank`): the :attr:`topology`'s."""
        return self.topology.data_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """``num_replicas``/``rank`` for the ``DistributedSampler`` of ``fabric.setup_dataloaders``; ``None`` when
        data is not sharded (one share). From :attr:`data_parallel_size` and :attr:`data_parallel_rank`."""
        size = self.data_parallel_size
        if size <= 1:
            return None
        return {"num_replicas": size, "rank": self.data_parallel_rank}

    def data_cursor(self) -> DataCursor | None:
        """Where each global batch of a set-up loader starts and its shares, when the strategy decides them
        (:class:`~fabric_core.utilities.global_order.DataCursor`); ``None`` (the default): the sampler walks the epoch
        itself with :attr:`distributed_sampler_kwargs`' shares. Asked once per loader by ``fabric.setup_dataloaders``.
        fabric-ft answers with the position the replica groups committed, so a step that was not committed is drawn
        again and a restarted group continues from the others' position."""
        return None

    def samples_trained(self) -> bool | Mapping[str, Any] | None:
        """After ``optimizer.step()``: whether the batches handed out since the last step were trained (the sample
        ledger records them then). ``True`` (the default): trained; ``False``: dropped, they will be drawn again (a
        fault-tolerant step that was not committed); ``None``: not decided yet (semi-synchronous training decides at
        its next synchronisation); a mapping: trained, with these facts added to the ledger's records of them."""
        return True

    def metrics(self) -> Mapping[str, float]:
        """What the strategy measures about itself, logged beside the user's metrics at every ``fabric.log``/
        ``fabric.log_dict`` (at the user's step; a name the user logs too keeps the user's value). Empty by default;
        fabric-ft gives the quorum's size and changes (``ft/quorum_size``, ``ft/quorum_changes``, ...). Must be cheap:
        it is asked at every log call."""
        return {}

    @property
    def backward_sync_control(self) -> BackwardSyncControl | None:
        """What ``fabric.no_backward_sync`` uses; ``None`` when the strategy cannot skip gradient sync."""
        return None

    @property
    def requires_fabric_backward(self) -> bool:
        """True when a plain ``loss.backward()`` would bypass something this strategy or precision needs."""
        return type(self).backward is not Strategy.backward or self.precision.requires_fabric_backward

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        """Called once per process, before anything is set up (process groups are created here)."""
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)

    def teardown(self) -> None:
        """Release what the strategy holds, after the saves still finishing in the background (their errors are
        raised here, and no thread of ours is left)."""
        from fabric_core.io import background  # deferred: only saving and loading need the checkpoint modules

        background.wait_all()
        self.precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self.configured_checkpoint_io is not None:
            self.configured_checkpoint_io.teardown()

    # ---------------------------------------------------------------------------------------- init contexts
    def tensor_init_context(self) -> AbstractContextManager:
        """``fabric.init_tensor()``: tensors created inside land on :attr:`root_device` with the precision's dtype."""
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.tensor_init_context())
        return stack

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=...)``: modules built inside are created on :attr:`root_device` in the
        precision's dtype; with ``empty_init=True`` their parameters are not initialised (a checkpoint will fill
        them). A sharding strategy returns a context that builds on the meta device and materialises each shard in
        :meth:`setup_module` instead."""
        from fabric_core.utilities.init import SkipParameterInit

        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(SkipParameterInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ---------------------------------------------------------------------------------------- setup
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """Set up a model with its optimizers (``fabric.setup(model, *optimizers)``); returns the module the forward
        pass goes through, the optimizers to step and the scheduler.

        Receives the plain module (already converted by the precision and moved by :meth:`module_to_device`) and the
        user's optimizers. By default :meth:`setup_module`, then the optimizers pointed at any parameter
        ``setup_module`` replaced (sharding replaces them), then :meth:`setup_optimizer` for each. Engines that own
        both (DeepSpeed) override this.
        """
        from fabric_core.utilities.parameters import record_parameters, replaced_parameters, rewire_optimizer

        places = record_parameters(module)
        module = self.setup_module(module)
        replaced = replaced_parameters(places)
        for optimizer in optimizers:
            rewire_optimizer(optimizer, replaced)
        optimizers = [self.setup_optimizer(o) for o in optimizers]
        return module, optimizers, scheduler

    def setup_module(self, module: Module) -> Module:
        """``fabric.setup(model)`` / ``fabric.setup_module(model)``, on every rank: return the module the forward pass
        goes through (the plain one, or wrapped, e.g. in DDP).

        Receives the plain module, already converted by the precision and moved by :meth:`module_to_device` (left
        on the meta device when built under ``init_module(empty_init=True)``). It may replace parameters in place
        (sharding into DTensors): ``fabric.setup`` then points optimizers created before at the new ones. The
        facade, not the strategy, calls ``precision.convert_module`` and wraps the result in a ``FabricModule``.
        """
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)``: return the optimizer to step (the plain one by default; its
        parameters already point at what :meth:`setup_module` put in the model)."""
        return optimizer

    def module_to_device(self, module: Module) -> None:
        """Move the plain module to :attr:`root_device` in place before :meth:`setup_module` (skipped for a model on
        the meta device, and when ``fabric.setup(..., move_to_device=False)``). A sharding strategy that places each
        shard itself makes this a no-op."""
        module.to(self.root_device)

    def batch_to_device(self, batch: Any, device: torch.device | None = None) -> Any:
        """``fabric.to_device(batch)`` and every batch of a set-up dataloader: tensors in any collection moved to
        ``device`` (default :attr:`root_device`)."""
        return move_data_to_device(batch, device or self.root_device)

    def process_dataloader(self, dataloader: Any) -> Any:
        """``fabric.setup_dataloaders``: the loader (after its sampler was replaced) to iterate; a strategy that
        feeds its devices itself wraps it (fabric-xla's device loader). The loader itself by default."""
        return dataloader

    def unwrap_module(self, module: Module) -> Module:
        """The user's module inside whatever ``setup_module`` wrapped it in."""
        return module

    # ---------------------------------------------------------------------------------------- training step
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss, model=...)``: ``module`` is the plain module (``None`` when not given). By default
        the precision's ``pre_backward`` (loss scaling), ``backward`` and ``post_backward``. An engine that owns the
        backward pass (DeepSpeed) overrides it; overriding it makes ``loss.backward()`` outside Fabric an error."""
        tensor = self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    def forward_backward(self, step: ForwardBackward) -> Tensor:
        """``fabric.forward_backward(model, *args, target=, loss_fn=, micro_batches=)``: one step's forward and
        backward over the micro-batches of ``step`` (:class:`~fabric_core.strategies.ForwardBackward`); returns the
        mean of the micro-batch losses, detached. By default ``step.run()``: each micro-batch through the model's
        forward and ``fabric.backward``, as a user's loop would. A strategy that must run forward and backward
        together (a pipeline schedule) overrides it; one that only adapts the inputs calls ``step.with_inputs(...)``
        and runs that."""
        return step.run()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` on a set-up optimizer: ``optimizer`` is the plain optimizer (or what
        :attr:`optimizer_step_target` returned for it); returns the step's result. By default the precision steps it
        (skipping the step on inf/NaN under loss scaling)."""
        return self.precision.optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``, with the plain module and optimizer: unscale
        the gradients (loss scaling), clip them by their total norm, return that norm (before clipping) as a plain
        tensor.

        Gradients that are DTensors (a strategy that shards parameters) are clipped by the norm over every shard on
        every rank (:func:`fabric_core.utilities.dtensor.clip_grad_norm`); call it on every rank.
        """
        from fabric_core.utilities.dtensor import clip_grad_norm

        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        return clip_grad_norm(parameters, float(max_norm), float(norm_type), error_if_nonfinite)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """``fabric.clip_gradients(model, optimizer, clip_val=...)`` with the plain module and optimizer: unscale, then
        clamp every gradient element to ``[-clip_val, clip_val]`` (elementwise, so shards need no communication)."""
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.precision.main_params(optimizer)), clip_value=clip_val)

    # ---------------------------------------------------------------------------------------- collectives
    @abstractmethod
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every process; the result is stacked along a new first dimension."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str | Any = "mean") -> Tensor:
        """Reduce ``tensor`` across processes (``"mean"``, ``"sum"``, ``"max"``, ``"min"``, ...)."""

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank ``src`` to every process."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable ``obj``, in rank order, on every process; call it on every rank. Used where
        ranks must learn what each other saw (which rank's checkpoint write failed, and why). This default sends each
        rank's object with :meth:`broadcast` in turn; the collectives classes do it in one exchange."""
        return [self.broadcast(obj if rank == self.global_rank else None, src=rank) for rank in range(self.world_size)]

    def checkpoint_coordinator(self) -> Coordinator:
        """What the background thread agrees over when it finishes an asynchronous multi-rank save: an object with
        ``is_global_zero``, ``broadcast``, ``reduce_boolean_decision`` and ``all_gather_object`` whose collectives do not interfere with the
        training loop's (one process: this strategy). Call it on every rank at the same point."""
        return self

    def prepare_barrier_without_timeout(self) -> None:  # noqa: B027 (optional hook)
        """Called by every rank at the same point before :meth:`barrier_without_timeout` is used."""

    def barrier_without_timeout(self, name: str | None = None) -> None:
        """A barrier that may wait longer than the collective timeout (``fabric.rank_zero_first``); a rank that
        fails must still end the wait promptly. The default is the ordinary barrier."""
        self.barrier(name)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether every process (``all=True``) or any process decided ``True``; call it on every rank. The
        collectives classes implement it (:class:`~fabric_core.strategies.collectives.Collectives`)."""
        return decision

    # ---------------------------------------------------------------------------------------- checkpoints
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The state a checkpoint stores for ``module`` (what ``fabric.setup`` returned, wrapped or not: the default
        unwraps it with :meth:`unwrap_module`). Called on every rank when saving.

        By default the plain module's ``state_dict()`` with DTensors (parameters a strategy sharded) gathered whole,
        so the single-file checkpoint rank 0 writes holds the full model and loads anywhere. A strategy with a
        sharded format of its own overrides :meth:`checkpoint_format` instead.
        """
        from fabric_core.utilities.dtensor import full_state

        return full_state(self.unwrap_module(module).state_dict())

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a full state dict (as :meth:`get_module_state_dict` gives it) into ``module`` in place, on every rank.

        By default into the plain module (:meth:`unwrap_module`); entries whose parameter or buffer is a DTensor are
        laid out like it first, so each rank keeps its own part of the whole tensor.
        """
        from fabric_core.utilities.dtensor import shard_full_tensors_on_load

        plain = self.unwrap_module(module)
        with shard_full_tensors_on_load(plain):
            plain.load_state_dict(dict(state_dict), strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state a checkpoint stores for ``optimizer`` (the user's optimizer, unwrapped); every rank calls it.

        By default ``optimizer.state_dict()`` with the states of DTensor parameters gathered whole.
        """
        from fabric_core.utilities.dtensor import full_state

        return full_state(optimizer.state_dict())

    def load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state (as :meth:`get_optimizer_state` gives it) into ``optimizer``, on every rank;
        the states of DTensor parameters are laid out like their parameter."""
        from fabric_core.utilities.dtensor import shard_optimizer_state

        optimizer.load_state_dict(shard_optimizer_state(optimizer, state))

    def checkpoint_context(self) -> FormatContext:
        """What a checkpoint format receives from this strategy (:class:`~fabric_core.io.format.FormatContext`):
        the coordinator, the module and optimizer state adapters (the four methods above), the precision's state,
        and the topology. Override to hand a format something else (fabric-fsdp hands full-state adapters);
        call it on every rank."""
        from fabric_core.io.format import FormatContext

        return FormatContext(
            coordinator=self,
            world_size=self.world_size,
            topology=self.topology,
            module_state=self.get_module_state_dict,
            load_module_state=self.load_module_state_dict,
            optimizer_state=self.get_optimizer_state,
            load_optimizer_state=self.load_optimizer_state,
            precision_state=self.precision.state_dict,
            load_precision_state=self.precision.load_state_dict,
            background_coordinator=self.checkpoint_coordinator,
        )

    def checkpoint_format(self) -> CheckpointFormat:
        """The format ``fabric.save`` writes: by default one file, through :attr:`checkpoint_io`, from global rank 0
        (:class:`~fabric_core.io.single_file.SingleFileFormat`). A sharding strategy returns its own."""
        from fabric_core.io.single_file import SingleFileFormat

        return SingleFileFormat(self.checkpoint_io, self._snapshots())

    def _snapshots(self) -> SnapshotBuffers:
        """The pinned buffers an asynchronous save reuses from one save to the next; made at the first save."""
        if self._snapshot_buffers is None:
            from fabric_core.io.snapshot import SnapshotBuffers

            self._snapshot_buffers = SnapshotBuffers()
        return self._snapshot_buffers

    def checkpoint_formats(self) -> list[CheckpointFormat]:
        """The formats this strategy loads, asked in order which recognises a path; the last one (the single file)
        takes any file, after the :attr:`registered_formats` were asked: a checkpoint of a registered format not
        listed here is read whole and restored through this strategy's adapters."""
        from fabric_core.io.single_file import SingleFileFormat

        return [SingleFileFormat(self.checkpoint_io, self._snapshots())]

    def save_checkpoint(
        self,
        path: CheckpointLocation | str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Filter | None = None,
        *,
        checkpoint_format: CheckpointFormat | None = None,
    ) -> None:
        """Write ``state`` at ``path`` in ``checkpoint_format`` (any format: ``fabric.save(...,
        checkpoint_format=NAME)`` passes a registered one; by default :meth:`checkpoint_format`), through this
        strategy's :meth:`checkpoint_context`; on return (on every rank) it is complete there."""
        from fabric_core.io.location import CheckpointLocation

        location = CheckpointLocation.of(path)
        (checkpoint_format or self.checkpoint_format()).write(
            location, state, self.checkpoint_context(), filter=filter, storage_options=storage_options
        )

    def save_checkpoint_async(
        self,
        path: CheckpointLocation | str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: Filter | None = None,
        *,
        checkpoint_format: CheckpointFormat | None = None,
    ) -> CheckpointHandle:
        """Snapshot ``state`` now and finish the save in the background (:meth:`CheckpointFormat.write_async`) in
        ``checkpoint_format`` (by default :meth:`checkpoint_format`); returns the save's handle (at its ``wait()``
        the checkpoint is at ``path`` and durable)."""
        from fabric_core.io.location import CheckpointLocation

        location = CheckpointLocation.of(path)
        return (checkpoint_format or self.checkpoint_format()).write_async(
            location, state, self.checkpoint_context(), filter=filter, storage_options=storage_options
        )

    def read_checkpoint(self, path: CheckpointLocation | str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a whole checkpoint into a dict in this process: a file memory-mapped, a folder through its format."""
        from fabric_core.io.format import format_for_loading
        from fabric_core.io.location import CheckpointLocation

        location = CheckpointLocation.of(path)
        checkpoint_format, _ = format_for_loading(location, self.checkpoint_formats(), self.registered_formats)
        return checkpoint_format.read(location, weights_only=weights_only)

    def load_checkpoint(
        self,
        path: CheckpointLocation | str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path`` and return what the checkpoint holds beyond it, through the
        format that recognises ``path`` (:func:`~fabric_core.io.format.format_for_loading`): its own ``load``, or,
        for a registered format this strategy does not own, read whole and restored through its adapters."""
        from fabric_core.io.format import format_for_loading
        from fabric_core.io.location import CheckpointLocation

        location = CheckpointLocation.of(path)
        checkpoint_format, foreign = format_for_loading(location, self.checkpoint_formats(), self.registered_formats)
        load = checkpoint_format.load_whole if foreign else checkpoint_format.load
        return load(location, state, self.checkpoint_context(), strict=strict, weights_only=weights_only)

    def own_format(self, checkpoint_format: CheckpointFormat) -> CheckpointFormat:
        """This strategy's own instance of ``checkpoint_format``'s kind when it has one (built with its
        ``CheckpointIO``, its owner lookups), else ``checkpoint_format``: what ``fabric.save(...,
        checkpoint_format=NAME)`` writes with."""
        own = [f for f in self.checkpoint_formats() if type(f) is type(checkpoint_format)]
        return own[0] if own else checkpoint_format

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device})"

