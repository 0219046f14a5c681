"""The ``Fabric`` facade: the one object a user's training loop talks to.

It resolves its arguments into plugin objects (:mod:`fabric_core.connector`) and then delegates every call to
the strategy. It never branches on a particular strategy family: what differs between them is expressed by
strategy attributes and hooks.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

# These packages import a submodule when it is first read (`io.background`, `loggers.base`, `utilities.data`):
# `Fabric()` imports only what the calls a script makes need (tests/core/test_import_budget.py).
from fabric_core import connector, io, loop, strategies, utilities
from fabric_core import loggers as experiment_loggers
from fabric_core.accelerators.base import Accelerator
from fabric_core.plugins.host import get_registry
from fabric_core.runtime import failures, goodput, hang, run
from fabric_core.runtime import ledger as runtime_ledger
from fabric_core.runtime.hang import counts_as_progress, start_watchdog
from fabric_core.runtime.run import RunInfo
from fabric_core.strategies.base import Strategy
from fabric_core.utilities.apply import apply_to_collection, convert_tensors_to_scalars, convert_to_tensors
from fabric_core.utilities.attach import callback_complaint, hand_fabric_to
from fabric_core.utilities.parameters import (
    ParameterPlaces,
    Replacements,
    check_optimizer_updates,
    record_parameters,
    replaced_parameters,
    rewire_optimizer,
)
from fabric_core.utilities.rank_zero import PossibleUserWarning, rank_zero_warn
from fabric_core.wrappers import (
    FabricDataLoader,
    FabricModule,
    FabricOptimizer,
    FastPaths,
    backward_guard,
    is_wrapped,
    unwrap_compiled,
    unwrap_objects,
)

if TYPE_CHECKING:
    from fabric_core.io.background import CheckpointHandle
    from fabric_core.io.format import CheckpointFormat
    from fabric_core.loggers.base import Logger
    from fabric_core.utilities.topology import Topology


def _do_nothing(*_: Any, **__: Any) -> None:
    pass


def _library_packages() -> dict[str, str]:
    """The installed plugins' packages, for the hang report (``fabric_library_packages``; asked when it starts)."""
    answers = get_registry().plugin_manager.hook.fabric_library_packages()
    return {package: role for answer in answers for package, role in (answer or {}).items()}


def _shards_without_data_parallel_ranks(strategy: Strategy, module: Module) -> bool:
    """Sharded (DTensor) parameters from a multi-process strategy that does not say which ranks share data."""
    return not strategies.layout.declares_data_parallel(strategy) and utilities.dtensor.has_dtensor_parameters(module)


def _checkpoint_section(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The time of ``fabric.save``/``load``/``latest_checkpoint`` is checkpoint time in the goodput ledger, with the
    checkpoint hang limit; a save's cost and step are recorded, and a load of one of this run's saves continues its
    step count (runtime/goodput.py)."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(method)
        def timed(self: Fabric, path: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            with goodput.section(goodput.CHECKPOINT):
                result = method(self, path, *args, **kwargs)
            ledger = goodput.current()
            if ledger is not None and kind != "look":
                key = str(io.CheckpointLocation.of(path))
                key = key if "://" in key else os.path.abspath(key)
                if kind == "save":
                    ledger.record_save(key, time.monotonic() - started)
                else:
                    ledger.resume(key)
            return result

        return timed

    return decorate


class Fabric:
    """Accelerate a plain PyTorch training loop on any device, strategy and precision.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"``, ``"gpu"``, ``"tpu"`` (with fabric-xla), ``"auto"`` or an
            :class:`~fabric_core.accelerators.Accelerator` instance. Names are case-insensitive.
        strategy: ``"auto"``, a registered name (``fabric plugins`` lists them) or a
            :class:`~fabric_core.strategies.Strategy` instance.
        devices: number of devices (processes) per node, ``"auto"``, or device indices (GPUs).
        num_nodes: number of nodes.
        precision: ``"32-true"`` (default), ``"64-true"``, ``"16-true"``, ``"bf16-true"``, ``"16-mixed"``,
            ``"bf16-mixed"`` (with fabric-amp), or the legacy ``32``, ``64``, ``16``, ``"bf16"``.
        plugins: a Precision, ClusterEnvironment or CheckpointIO object, or a list of them.
        callbacks: any objects (or a list of them) whose methods :meth:`call` invokes by name.
        loggers: the loggers :meth:`log` and :meth:`log_dict` write to: a registered name (``"csv"``,
            ``"tensorboard"``, ``"wandb"`` with fabric-wandb, ...; ``fabric plugins --kind logger`` lists them),
            ``{name: options}`` to pass options, a logger object (any object with the reference's ``Logger`` members:
            ``name``, ``version``, ``log_metrics``, ``log_hyperparams``), or a list mixing these.
        run_dir: the run folder, where records that outlive a restart go (the goodput ledger, ...): the same in every
            attempt of the run. Default: ``FABRIC_RUN_DIR``, else ``<loggers' root>/runs/<run id>``
            (:attr:`run_info`; docs/decisions.md, "Run identity").
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: list[int] | str | int = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        plugins: Any = None,
        callbacks: Any = None,
        loggers: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        # In a process a launcher started (ours or torchrun): an uncaught error goes to the launcher's error file
        # too, so the job's last words quote the rank that failed first (fabric_core/utilities/failures.py).
        failures.record_uncaught_errors()
        resolved = connector.resolve(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            plugins=plugins,
        )
        self._accelerator = resolved.accelerator
        self._strategy = resolved.strategy
        self._precision = resolved.precision
        self._callbacks: list[Any] = _as_list(callbacks, "callbacks", callback_complaint)
        self._loggers: list[Logger] = connector.resolve_loggers(loggers)
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"`Fabric(run_dir=...)` must be a path (str or os.PathLike), got {run_dir!r}.")
        self._run_dir = run_dir
        self._run_info: RunInfo | None = None
        #: the checkpoint tiers made by `checkpoint_tiers` (their checkpoints load through them)
        self._tiers: Any = None
        self._models_setup = 0
        self._launched = False
        #: what `backward` may skip for the strategy's precision (wrappers.FastPaths)
        self._paths = FastPaths(self._strategy)
        #: parameters that setting up a model replaced, for optimizers set up afterwards (`setup_optimizers`)
        self._replaced: Replacements = {}

        if type(self).run is not Fabric.run:
            if connector.launched_by_cli():
                raise TypeError(
                    "Overriding `Fabric.run()` and launching from the CLI is not allowed. Run the script with"
                    " `python script.py`, or call your function through `fabric.launch(fn)` instead of overriding run."
                )
            self.run = partial(self._wrap_and_launch, self.run)  # type: ignore[method-assign]

        self._monitoring = False
        self._goodput_logged_at_end = False
        self._goodput_at_exit = False
        if connector.launched_by_cli():
            self._strategy.setup_environment()
            self._launched = True
            self._start_monitoring()

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def accelerator(self) -> Accelerator:
        return self._accelerator

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def run_info(self) -> RunInfo:
        """This run's id, this attempt's number and the run folder (the same on every rank; the id and the folder
        in every attempt). See :mod:`fabric_core.runtime.run`."""
        if self._run_info is not None:
            return self._run_info
        info = run.resolve_run(self._run_dir, logs_root=run.logs_root(self._loggers))
        if not (self._launched or not self._strategy.requires_launch):
            return info  # before launch() the ranks are not known yet: nobody keeps the record
        info = dataclasses.replace(
            info,
            keeps_record=self.is_global_zero,
            details={"world_size": self.world_size, "num_nodes": self._strategy.num_nodes},
        )
        self._run_info = info
        return info

    @property
    def topology(self) -> Topology:
        """Where this process sits: nodes x processes, and every named axis of the strategy (data-parallel replicas
        and shards, tensor, pipeline, sequence, fault-tolerant replica groups) with its size and this process's
        coordinate. A fresh snapshot on every read: sizes can change with a quorum or a restart."""
        return self._strategy.topology

    @property
    def loggers(self) -> list[Logger]:
        return self._loggers

    @property
    def logger(self) -> Logger:
        """The first logger. Raises ``IndexError`` when none was given."""
        if not self._loggers:
            raise IndexError("This Fabric has no loggers: pass `Fabric(loggers=...)` to use `fabric.logger`.")
        return self._loggers[0]

    # ------------------------------------------------------------------------------------------------ launching
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override this with your training code; calling it launches the processes first."""

    def launch(self, function: Callable[..., Any] = _do_nothing, *args: Any, **kwargs: Any) -> Any:
        """Start the processes of a multi-device run; optionally run ``function(fabric, *args, **kwargs)`` in each.

        Without a function, the script itself continues in every process (the default launcher re-runs it for
        the other local ranks). Spawn-type strategies can only run a function.
        """
        if connector.launched_by_cli():
            raise RuntimeError(
                "This script was launched through the CLI, and processes have already been created. Calling "
                " `.launch()` again is not allowed."
            )
        if function is not _do_nothing:
            if not callable(function):
                raise TypeError(
                    f"`Fabric.launch(...)` needs to be a callable, but got {function!r}."
                    " HINT: do `.launch(your_fn)` instead of `.launch(your_fn())`"
                )
            if not inspect.signature(function).parameters:
                raise TypeError(
                    f"`Fabric.launch(function={function!r})` needs to take at least one argument. The launcher will"
                    " pass in the `Fabric` object, so you can use it inside the function."
                )
        elif self._strategy.launcher is not None and self._strategy.launcher.requires_function:
            raise TypeError(
                f"To spawn processes with the `{type(self._strategy).__name__}` strategy, `.launch()` needs to be"
                " called with a function that contains the code to launch in processes."
            )
        return self._wrap_and_launch(function, self, *args, **kwargs)

    def _wrap_and_launch(self, to_run: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._launched:
            raise RuntimeError(
                "`fabric.launch()` was already called for this Fabric object: the processes exist already. Call it"
                " once, at the start; to run more code in every process, call your function directly."
            )
        self._launched = True
        to_run = partial(self._wrap_with_setup, to_run)
        launcher = self._strategy.launcher
        if launcher is not None:
            return launcher.launch(to_run, *args, **kwargs)
        return to_run(*args, **kwargs)

    def _start_monitoring(self) -> None:
        """Once the ranks are known: the goodput ledger, and the monitor thread (hang detection, stragglers, the
        ledger's records; runtime/hang.py). A single process without loggers or a chosen run folder keeps none."""
        if self._monitoring:
            return
        self._monitoring = True
        info = self.run_info
        write = info.chosen or bool(self._loggers)
        if write or self.world_size > 1 or hang.hang_timeout() is not None:
            from fabric_core.runtime import chaos, goodput_report

            injector = chaos.injector_from_environment(self.global_rank, self.node_rank, info.dir)  # FABRIC_CHAOS
            goodput.start(
                info, self.global_rank, self.world_size, write=write, injector=injector, at_end=goodput_report.write_summary_at_end
            )
            goodput.set_event_handler(self._on_run_event)
        start_watchdog(self.global_rank, _library_packages, world_size=self.world_size, job=info.job, restart=info.restart)

    def _on_run_event(self, event: Any) -> None:
        """What the monitor thread found, on the main thread at a step: a straggler goes to the loggers (global rank
        0) and to every rank's ``on_straggler`` callbacks."""
        from fabric_core.runtime.stragglers import Straggler

        if isinstance(event, Straggler):
            ledger = goodput.current()
            if self.is_global_zero and self._loggers:
                metrics = {
                    "straggler/rank": event.rank,
                    "straggler/slower_s": event.slower_s,
                    "straggler/slower_share": event.slower_share,
                    "straggler/since_step": event.since_step,
                }
                self.log_dict(metrics, step=ledger.global_step if ledger is not None else None)
            self.call("on_straggler", fabric=self, straggler=event)

    def section(self, name: str, *, hang_limit: float | None = None) -> AbstractContextManager[None]:
        """A stretch of the script that is not training steps: its time counts as ``name`` in the goodput ledger
        (not as the step it interrupts), and the hang detector gives it ``hang_limit`` seconds without progress
        (default: 60 minutes) instead of the step limit::

            with fabric.section("evaluation"):
                if fabric.is_global_zero:
                    evaluate(model)        # minutes of work on rank 0 alone
                fabric.barrier()           # inside: the other ranks' wait counts as evaluation too

        The ranks that wait meanwhile (in the barrier) are not flagged: they wait in a collective, and rank 0 is
        within its section's limit. Nested sections count as the outermost."""
        return goodput.section(name, hang_limit)

    def _wrap_with_setup(self, to_run: Callable, *args: Any, **kwargs: Any) -> Any:
        self._strategy.setup_environment()
        self._start_monitoring()
        try:
            with utilities.data.capture_init_arguments():
                return to_run(*args, **kwargs)
        except BaseException as err:  # Ctrl-C or sys.exit(1) fails the run as much as an error: marked, then raised
            # The run failed: trackers mark it failed now (a spawned process never runs atexit handlers).
            if not (isinstance(err, SystemExit) and err.code in (0, None)):
                for logger_error in self._finalize_loggers("failed"):
                    err.add_note(f"Finalizing a logger failed as well: {type(logger_error).__name__}: {logger_error}")
            raise

    def log_goodput(self, step: int | None = None) -> dict[str, float]:
        """Log the run's goodput shares so far (every attempt, all ranks' records) to the loggers, from global rank 0:
        ``goodput/<category>_share`` and ``goodput/goodput``; returns them (``{}`` on the other ranks, or when the run
        keeps no goodput records). ``step``: default the run's step count. Done by itself at ``teardown()`` and at
        exit when the run folder was chosen (``run_dir=``, ``FABRIC_RUN_DIR``, ``FABRIC_RUN_ID``)."""
        ledger = goodput.current()
        if not self.is_global_zero or ledger is None or not ledger.write or ledger.info is None:
            return {}
        from fabric_core.runtime import goodput_report

        ledger.flush()
        try:
            values = goodput_report.metrics(goodput_report.summarize(ledger.info.dir))
        except goodput_report.GoodputReportError:
            return {}
        self.log_dict(values, step=ledger.global_step if step is None else step)
        return values

    def _log_goodput_at_end(self) -> None:
        """At teardown or exit, once, when the user chose the run folder (opting into goodput): the shares go to the
        loggers. Not by default: a script's loggers hold what it logged, as the reference's do. Never raises."""
        if self._goodput_logged_at_end or not self._loggers or not self._monitoring or not self.run_info.chosen:
            return
        self._goodput_logged_at_end = True
        try:
            self.log_goodput()
        except Exception as err:  # a tracker's client may raise anything: at teardown the run's own outcome stands
            rank_zero_warn(f"Logging the goodput shares at the end of the run failed: {type(err).__name__}: {err}")

    def _finalize_loggers(self, status: str) -> list[Exception]:
        """Finalize every logger (those without ``finalize`` are skipped); returns the errors they raised."""
        return experiment_loggers.base.finalize_loggers(self._loggers, status)

    def _validate_launched(self) -> None:
        if not self._launched and self._strategy.requires_launch:
            raise RuntimeError(
                "To use Fabric with more than one device, you must call `.launch()` or use the CLI:"
                " `fabric run --help`."
            )

    def teardown(self) -> None:
        """End the run early and cleanly: finalize the loggers and release what the strategy set up.

        Destroys the process group this Fabric created (every rank should call it, after its last collective),
        and lets the precision, accelerator and checkpoint I/O release what they hold. Not needed at the end of
        a script: the process group is released at interpreter exit anyway. Calling it twice is harmless;
        collectives after it raise.
        """
        self._log_goodput_at_end()
        ledger = goodput.current()
        if ledger is not None:
            ledger.flush()  # the goodput record as of the end of the run
        errors = self._finalize_loggers("success")
        if self._tiers is not None:
            self._tiers.close(finished=False)
        self._strategy.teardown()
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------------------------------------ setup
    @counts_as_progress
    def setup(
        self, module: Module, *optimizers: Optimizer, scheduler: Any = None, move_to_device: bool = True, _reapply_compile: bool = True
    ) -> Any:
        """Set up a model and its optimizers; returns ``model`` or ``(model, *optimizers[, scheduler])``."""
        self._validate_launched()
        if not self._monitoring and not self._strategy.requires_launch:
            self._start_monitoring()  # one process, never launched: its ledger starts with its first model
        self._validate_setup(module, optimizers, "setup")
        module, compile_kwargs = self._unwrap_compiled(module, _reapply_compile)
        original = module
        places = record_parameters(module)
        module = self._precision.convert_module(module)
        if move_to_device:
            module = self._move_model_to_device(module, list(optimizers))
        if optimizers:
            self._rewire(optimizers, replaced_parameters(places))  # conversions that replaced parameters
            forward_module, opts, scheduler = self._strategy.setup_module_and_optimizers(module, list(optimizers), scheduler)
        else:
            forward_module, opts = self._strategy.setup_module(module), []
        self._after_strategy_setup(forward_module, places, optimizers, "setup")
        if compile_kwargs is not None:
            forward_module = torch.compile(forward_module, **compile_kwargs)
        wrapped = FabricModule(forward_module, self._strategy, original_module=original)
        wrapped_opts = [FabricOptimizer(o, self._strategy, self._callbacks) for o in opts]
        self._models_setup += 1
        hand_fabric_to(original, self, self._callbacks, wrapped_opts)  # a LightningModule logs and hooks through us
        self.call("on_after_setup", fabric=self, module=wrapped)
        if not optimizers:
            return wrapped
        if scheduler is not None:
            return (wrapped, *wrapped_opts, scheduler)
        return (wrapped, *wrapped_opts)

    @counts_as_progress
    def setup_module(self, module: Module, move_to_device: bool = True, _reapply_compile: bool = True) -> FabricModule:
        """Set up a model alone (then create its optimizer and call :meth:`setup_optimizers`)."""
        self._validate_launched()
        if not self._monitoring and not self._strategy.requires_launch:
            self._start_monitoring()
        self._validate_setup(module, (), "setup_module")
        module, compile_kwargs = self._unwrap_compiled(module, _reapply_compile)
        original = module
        places = record_parameters(module)
        module = self._precision.convert_module(module)
        if move_to_device:
            module = self._move_model_to_device(module, [])
        forward_module = self._strategy.setup_module(module)
        self._after_strategy_setup(forward_module, places, (), "setup_module")
        if compile_kwargs is not None:
            forward_module = torch.compile(forward_module, **compile_kwargs)
        self._models_setup += 1
        hand_fabric_to(original, self, self._callbacks)  # the reference leaves `_fabric_optimizers` to setup()
        return FabricModule(forward_module, self._strategy, original_module=original)

    @counts_as_progress
    def setup_optimizers(self, *optimizers: Optimizer) -> FabricOptimizer | tuple[FabricOptimizer, ...]:
        """Set up optimizers of an already set-up model; one in, one out, several in, a tuple out."""
        self._validate_launched()
        if self._strategy.requires_joint_setup:
            raise RuntimeError(
                f"The `{type(self._strategy).__name__}` requires the model and optimizer(s) to be set up jointly"
                " through `.setup(model, optimizer, ...)`."
            )
        if not optimizers:
            raise ValueError("`setup_optimizers` requires at least one optimizer as input.")
        if any(isinstance(o, FabricOptimizer) for o in optimizers):
            raise ValueError("An optimizer should be passed only once to the `setup_optimizers` method.")
        _check_optimizers(optimizers, "fabric.setup_optimizers")
        self._rewire(optimizers, self._replaced)  # an optimizer created before `setup_module` replaced parameters
        self._check_meta_params(optimizers, joint=False)
        wrapped = tuple(FabricOptimizer(self._strategy.setup_optimizer(o), self._strategy, self._callbacks) for o in optimizers)
        return wrapped[0] if len(wrapped) == 1 else wrapped

    @counts_as_progress
    def setup_dataloaders(
        self,
        *dataloaders: DataLoader,
        use_distributed_sampler: bool = True,
        move_to_device: bool = True,
        global_batch_size: int | None = None,
    ) -> DataLoader | list[DataLoader]:
        """Shard (when the strategy runs several processes), seed workers, and move batches to the device.

        Under a data-parallel strategy the ranks take shares of one global order that does not depend on their
        number, so a checkpoint resumes on any number of ranks without losing or repeating a sample
        (docs/decisions.md, "Elastic training"). ``global_batch_size`` keeps the global batch at that size whatever the
        number of ranks: each rank's batch becomes its share of it (the loader's ``batch_size`` is replaced).
        """
        self._validate_launched()
        if not dataloaders:
            raise ValueError("`setup_dataloaders` requires at least one dataloader as input.")
        if any(isinstance(d, FabricDataLoader) for d in dataloaders):
            raise ValueError("A dataloader should be passed only once to the `setup_dataloaders` method.")
        if any(not isinstance(d, DataLoader) for d in dataloaders):
            raise TypeError("Only PyTorch DataLoader are currently supported in `setup_dataloaders`.")
        if global_batch_size is not None and not use_distributed_sampler:
            raise ValueError(
                "`global_batch_size` cuts every global batch into the ranks' shares, which needs Fabric's distributed"
                " sampler: drop `use_distributed_sampler=False`, or drop `global_batch_size` and batch yourself."
            )
        wrapped = [
            self._setup_dataloader(d, use_distributed_sampler, move_to_device, global_batch_size) for d in dataloaders
        ]
        return wrapped[0] if len(wrapped) == 1 else wrapped  # type: ignore[return-value]

    def _setup_dataloader(
        self, dataloader: DataLoader, use_distributed_sampler: bool, move_to_device: bool, global_batch_size: int | None = None
    ) -> Any:
        kwargs = self._strategy.distributed_sampler_kwargs
        if global_batch_size is not None and kwargs is None:
            kwargs = {"num_replicas": 1, "rank": 0}  # one process takes the whole global batch
        if use_distributed_sampler and kwargs is not None:
            # Every rank reads the same seed without communicating (docs/decisions.md, "Data"): the shuffle of a
            # DistributedSampler and the order of a wrapped sampler are functions of (seed, epoch).
            global_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            ordered = utilities.data.global_order_sampler_for(
                dataloader,
                seed=global_seed,
                global_batch_size=global_batch_size,
                cursor=self._strategy.data_cursor(),
                **kwargs,
            )
            sampler = ordered or utilities.data.distributed_sampler_for(dataloader, seed=global_seed, **kwargs)
            if sampler is not None:
                share = ordered.share_size() if ordered is not None and global_batch_size is not None else None
                dataloader = utilities.data.reinstantiate_dataloader(dataloader, sampler, batch_size=share)
            elif (
                isinstance(dataloader.dataset, IterableDataset)
                and kwargs.get("num_replicas", 1) > 1
                and not utilities.data.shards_itself(dataloader.dataset, kwargs["num_replicas"])
            ):
                replicas = kwargs["num_replicas"]
                rank_zero_warn(
                    f"Your `{type(dataloader.dataset).__name__}` is an `IterableDataset`, which Fabric cannot split"
                    f" with a distributed sampler: each of the {replicas} processes iterates all of it, so every"
                    " sample is seen once per process. If that is not what you want, shard it yourself in its"
                    " `__iter__`, e.g. by `fabric.global_rank` and `fabric.world_size` (keep every"
                    " `world_size`-th item starting at `global_rank`, and split further by"
                    " `torch.utils.data.get_worker_info()` with workers), and give it a `world_size` attribute so"
                    " Fabric knows. If every process should see all of it, silence this with"
                    " `warnings.filterwarnings('ignore', category=PossibleUserWarning)`.",
                    category=PossibleUserWarning,
                )
        if os.environ.get("PL_SEED_WORKERS") == "1" and dataloader.worker_init_fn is None:
            dataloader.worker_init_fn = partial(utilities.seed.worker_init_function, rank=self.global_rank)
        dataloader = self._strategy.process_dataloader(dataloader)
        device = self.device if move_to_device else None
        if os.environ.get(runtime_ledger.LEDGER_VARIABLE):
            runtime_ledger.active(self.run_info)  # FABRIC_SAMPLE_LEDGER=1: the ledger goes into the run folder
        # The ledger counts what the run trained: one record per data-parallel share, not one per model-axis peer.
        records = all(axis.coordinate == 0 for axis in self._strategy.topology.axes if not axis.splits_data)
        return FabricDataLoader(dataloader, device=device, record_samples=records)

    def _validate_setup(self, module: Module, optimizers: Iterable[Optimizer], method: str) -> None:
        if isinstance(module, FabricModule) or is_wrapped(module):
            raise ValueError(f"A model should be passed only once to the `{method}` method.")
        if not isinstance(module, Module):
            raise TypeError(
                f"`fabric.{method}` expects a `torch.nn.Module` as its first argument, got {type(module).__name__}."
                " Call it like `model, optimizer = fabric.setup(model, optimizer)`."
            )
        if any(isinstance(o, FabricOptimizer) for o in optimizers):
            raise ValueError(f"An optimizer should be passed only once to the `{method}` method.")
        _check_optimizers(optimizers, f"fabric.{method}")
        if optimizers:
            self._check_meta_params(optimizers, joint=True)
            params = {id(p) for p in module.parameters()}
            for index, optimizer in enumerate(optimizers):
                own = [p for group in optimizer.param_groups for p in group["params"]]
                if own and params and not any(id(p) in params for p in own):
                    raise ValueError(
                        f"Optimizer {index} passed to `fabric.{method}` updates none of the model's parameters, so the"
                        " model would never train. Create it from this model: `torch.optim.AdamW(model.parameters())`,"
                        " then `model, optimizer = fabric.setup(model, optimizer)`."
                    )

    @staticmethod
    def _rewire(optimizers: Iterable[Optimizer], replaced: Replacements) -> None:
        if replaced:
            for optimizer in optimizers:
                rewire_optimizer(optimizer, replaced)

    def _after_strategy_setup(
        self, forward_module: Module, places: ParameterPlaces, optimizers: Iterable[Optimizer], method: str
    ) -> None:
        """What must hold once the strategy has set the model up, whatever the strategy (docs/decisions.md,
        "Strategies we did not write"): optimizers update the parameters the model now has, and a model whose
        parameters are sharded (DTensors) comes from a strategy that says which processes share data."""
        replaced = replaced_parameters(places)
        self._replaced = {k: v for k, v in self._replaced.items() if v[0]() is not None} | replaced
        module = self._strategy.unwrap_module(forward_module)
        name = type(self._strategy).__name__
        for index, optimizer in enumerate(optimizers):
            rewire_optimizer(optimizer, replaced)
            if not self._strategy.requires_joint_setup:  # an engine that owns the optimizer may repoint it itself
                check_optimizer_updates(optimizer, index, module, name, method)
        if self._strategy.world_size > 1 and _shards_without_data_parallel_ranks(self._strategy, module):
            raise ValueError(
                f"`{name}` set the model up with sharded (DTensor) parameters but does not say which of its"
                f" {self._strategy.world_size} processes train on the same data, so `fabric.setup_dataloaders` would"
                " give every process its own batches, which is wrong for tensor-parallel peers. The strategy must"
                " declare `data_parallel_rank` and `data_parallel_size` (for a strategy that shards only over data"
                " parallel processes, such as FSDP, they are the global rank and the world size)."
            )

    def _check_meta_params(self, optimizers: Iterable[Optimizer], joint: bool) -> None:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if any(p.is_meta for p in group["params"]):
                    hint = (
                        "set up the model first with `model = fabric.setup_module(model)`, create the optimizer"
                        " after that, then call `optimizer = fabric.setup_optimizers(optimizer)`."
                    )
                    if joint:
                        raise RuntimeError(
                            "The optimizer has references to the model's meta-device parameters. Materializing them"
                            f" is not supported through `.setup(model, optimizer)`: set up the model and optimizer(s)"
                            f" separately: {hint}"
                        )
                    raise RuntimeError(
                        "The optimizer has references to the model's meta-device parameters. Create the optimizer"
                        " after setting up the model, then call `fabric.setup_optimizers(optimizer)`."
                    )

    def _unwrap_compiled(self, module: Module, reapply: bool) -> tuple[Module, dict[str, Any] | None]:
        inner, kwargs = unwrap_compiled(module)
        if inner is module or not reapply:
            return module, None
        if kwargs is None:
            # Re-compiling with torch's defaults (inductor) instead of the user's choice would be a silent change.
            raise RuntimeError(
                "Failed to determine the arguments that were used to compile the module. Call `torch.compile` on"
                " the module returned by `fabric.setup(...)` instead, set `module._fabric_compile_kwargs = {...}`"
                " on the compiled module, or pass `_reapply_compile=False`."
            )
        return inner, kwargs

    def _move_model_to_device(self, module: Module, optimizers: list[Optimizer]) -> Module:
        named = list(module.named_parameters())
        if named:
            first_name, first = named[0]
            elsewhere = [(n, p.device) for n, p in named if p.device != first.device]
            if elsewhere:
                name, device = elsewhere[0]
                rank_zero_warn(
                    f"The model passed to `Fabric.setup()` has {len(elsewhere)} parameters on different devices (for"
                    f" example {name!r} on {device} and {first_name!r} on {first.device}). Since"
                    " `move_to_device=True`, all parameters will be moved to the new device. If this is not"
                    " desired, set `Fabric.setup(..., move_to_device=False)`.",
                    category=PossibleUserWarning,
                )
        if any(p.is_meta for _, p in named):
            return module  # materialised by the strategy (e.g. FSDP) shard by shard
        if self._launched or not self._strategy.requires_launch:
            self._accelerator.setup_device(self.device)
        self._strategy.module_to_device(module)
        return module

    # ------------------------------------------------------------------------------------------------ training
    def backward(self, tensor: Tensor, *args: Any, model: Any = None, **kwargs: Any) -> None:
        """Replace ``loss.backward()``: lets the precision scale the loss and engines own the backward pass."""
        # One frame on every step: the plan says whether the strategy's chain would only call `tensor.backward`.
        if goodput.marking:
            goodput.on_backward()
        strategy = self._strategy
        paths = self._paths
        if strategy.configured_precision is not paths.precision:  # a replaced precision: decide again
            paths = self._paths = FastPaths(strategy)
        if not paths.backward:
            module = unwrap_objects(model) if model is not None else None
            with backward_guard.scope():
                strategy.backward(tensor, module, *args, **kwargs)
        elif backward_guard.armed:  # some model (of any Fabric) guards its outputs: this is a Fabric backward
            with backward_guard.scope():
                tensor.backward(*args, **kwargs)
        elif args or kwargs:
            tensor.backward(*args, **kwargs)
        else:
            tensor.backward()  # the call exactly as a plain loop makes it

    @counts_as_progress
    def forward_backward(
        self,
        model: Any,
        *args: Any,
        loss_fn: Callable[..., Tensor],
        target: Any = None,
        micro_batches: int | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """One step's forward and backward: ``loss_fn(model(*args, **kwargs), target)`` over the batch, cut into
        ``micro_batches`` equal parts along the first dimension; then ``optimizer.step()`` as usual.

        Returns the mean of the micro-batch losses (detached): the batch's loss when ``loss_fn`` averages over
        samples, and the gradients are those of that mean. By default each micro-batch runs through the model and
        :meth:`backward`, gradients synchronising on the last; a pipeline-parallel strategy runs its schedule over
        the micro-batches instead (``micro_batches=None``: the strategy's setting, else one), a sequence-parallel
        one shards the sequence first. The same loop runs on every strategy (:mod:`fabric_core.strategies.forward_backward`).
        """
        from fabric_core.strategies.forward_backward import ForwardBackward, check_micro_batches

        module, _ = unwrap_compiled(model)
        if not isinstance(module, FabricModule):
            raise TypeError(
                "`fabric.forward_backward` needs the model returned by `fabric.setup(...)`, got a"
                f" {type(model).__name__}: `model, optimizer = fabric.setup(model, optimizer)` first."
            )
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be a callable `loss_fn(output, target) -> loss`, got {type(loss_fn).__name__}."
            )
        control = self._strategy.backward_sync_control

        def no_backward_sync(enabled: bool) -> AbstractContextManager:
            # As in `fabric.accumulate`: a strategy that cannot skip the sync synchronises every micro-batch, silently.
            return control.no_backward_sync(module.strategy_module, enabled) if enabled and control else nullcontext()

        step = ForwardBackward(
            module=module.strategy_module,
            args=args,
            kwargs=kwargs,
            target=target,
            loss_fn=loss_fn,
            micro_batches=check_micro_batches(micro_batches),
            forward=model,
            backward=lambda loss: self.backward(loss, model=model),
            no_backward_sync=no_backward_sync,
        )
        return self._strategy.forward_backward(step)

    def clip_gradients(
        self,
        module: Module,
        optimizer: Optimizer,
        clip_val: float | int | None = None,
        max_norm: float | int | None = None,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor | None:
        """Clip by value (returns ``None``) or by norm (returns the total norm *before* clipping)."""
        if clip_val is not None and max_norm is not None:
            raise ValueError(
                "Only one of `clip_val` or `max_norm` can be set as this specifies the underlying clipping algorithm!"
            )
        if clip_val is None and max_norm is None:
            raise ValueError("You have to specify either `clip_val` or `max_norm` to do gradient clipping!")
        module = unwrap_objects(module)
        optimizer = unwrap_objects(optimizer)
        if clip_val is not None:
            self._strategy.clip_gradients_value(module, optimizer, clip_val=clip_val)
            return None
        norm = self._strategy.clip_gradients_norm(
            module, optimizer, max_norm=cast(float, max_norm), norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        return utilities.dtensor.to_full_tensor(norm)  # a plain tensor, also from a strategy that returns the norm as a DTensor

    def autocast(self) -> AbstractContextManager:
        """The precision's forward context, for code that runs outside the model's forward."""
        return self._precision.forward_context()

    def init_tensor(self) -> AbstractContextManager:
        """Create tensors directly on the device and in the precision's dtype."""
        return self._strategy.tensor_init_context()

    def init_module(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Build a model directly on the device / in the precision's dtype; ``empty_init`` skips weight init."""
        self._validate_launched()
        return self._strategy.module_init_context(empty_init=empty_init)

    def no_backward_sync(self, module: Any, enabled: bool = True) -> AbstractContextManager:
        """Skip gradient synchronisation in backward while accumulating gradients over micro-batches."""
        module, _ = unwrap_compiled(module)
        if not isinstance(module, FabricModule):
            raise TypeError(
                "You need to set up the model first before you can call `fabric.no_backward_sync()`:"
                " `model = fabric.setup(model, ...)`"
            )
        control = self._strategy.backward_sync_control
        if control is None:
            rank_zero_warn(
                f"The `{type(self._strategy).__name__}` does not support skipping the gradient synchronization."
                " Remove `.no_backward_sync()` from your code or choose a different strategy.",
                category=PossibleUserWarning,
            )
            return nullcontext()
        return control.no_backward_sync(module.strategy_module, enabled)

    def accumulate(self, module: Any, steps: int) -> AbstractContextManager[bool]:
        """One micro-batch of ``steps``: gradients sync on the last only, which yields ``True`` (:mod:`.loop.accumulate`)."""
        return loop.accumulate(self, module, steps)

    def profile(self, dirpath: str | Path = "fabric_profile", **kwargs: Any) -> AbstractContextManager[Any]:
        """``torch.profiler`` on every rank, traces in ``dirpath/rank<r>``, a rank-zero summary (:mod:`.loop.profile`)."""
        return loop.profile(self, dirpath, **kwargs)

    # ------------------------------------------------------------------------------------------------ data
    def to_device(self, obj: Any) -> Any:
        """Move a module (in place) or a nested collection of tensors to this process's device."""
        if isinstance(obj, Module):
            self._accelerator.setup_device(self.device)
            self._strategy.module_to_device(obj)
            return obj
        return self._strategy.batch_to_device(obj, self.device)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the first process of each node only."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    # ------------------------------------------------------------------------------------------------ collectives
    @counts_as_progress
    def barrier(self, name: str | None = None) -> None:
        self._validate_launched()
        self._strategy.barrier(name=name)

    @counts_as_progress
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._validate_launched()
        return self._strategy.broadcast(obj, src=src)

    @counts_as_progress
    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Gather tensors (or a collection of them) from every process: each becomes ``(world_size, ...)``."""
        self._validate_launched()
        data = convert_to_tensors(data, device=self.device)
        return apply_to_collection(data, Tensor, self._strategy.all_gather, group=group, sync_grads=sync_grads)

    @counts_as_progress
    def all_reduce(self, data: Any, group: Any | None = None, reduce_op: str | Any = "mean") -> Any:
        """Reduce tensors (or a collection) across processes with ``"mean"`` (default), ``"sum"``, ``"max"``..."""
        self._validate_launched()
        data = convert_to_tensors(data, device=self.device)
        return apply_to_collection(data, Tensor, self._strategy.all_reduce, group=group, reduce_op=reduce_op)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Run the block on rank 0 first (e.g. a download), then on all others."""
        rank = self.local_rank if local else self.global_rank
        # The others may wait much longer than the collective timeout (a download): no time limit for them. If rank
        # 0 fails instead, its process ends, its connections close, and the others fail at once.
        self._strategy.prepare_barrier_without_timeout()
        if rank > 0:
            self._strategy.barrier_without_timeout("rank_zero_first:before")
        yield
        if rank == 0:
            self._strategy.barrier_without_timeout("rank_zero_first:before")
        self._strategy.barrier("rank_zero_first:after")

    # ------------------------------------------------------------------------------------------------ checkpoints
    @counts_as_progress
    @_checkpoint_section("save")
    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
        *,
        async_save: bool = False,
        keep_last: int | None = None,
        checkpoint_format: str | CheckpointFormat | None = None,
    ) -> CheckpointHandle | None:
        """Save ``state`` (models, optimizers, anything with ``state_dict``, plain values) crash-safely.

        ``path`` is a local path or a URL (``s3://``, ``gs://``, ``memory://``, ... through fsspec). When the call
        returns on every rank, the checkpoint is complete and readable at ``path`` and has replaced the previous one
        atomically (a process killed at any instant leaves the previous or the new one, never a torn one). Only
        durability against a power cut (the ``fsync`` of the file and its folder) may still run in the background.

        Args:
            async_save: return as soon as a snapshot of the state is taken (a CPU copy of its tensors, reused by the
                next asynchronous save); writing and committing run in the background while training changes the
                live objects. The checkpoint is at ``path`` when the handle's ``wait()`` returns.
            keep_last: keep only the newest ``keep_last`` checkpoints of the series ``path`` belongs to (the entries
                beside it whose names differ only in their numbers, e.g. ``step-*.ckpt``), once this one is durable.
            checkpoint_format: write in this format instead of the strategy's own: the name a plugin registered it
                under (``"fsdp_sharded"``, ``"npz"``; ``fabric plugins --kind checkpoint_format`` lists them) or a
                ``CheckpointFormat`` object. ``fabric.load`` finds it again by itself (the registered format
                recognises its checkpoints).

        Returns a handle (the reference returns ``None``): ``wait()`` blocks until the save's background part is done
        (durable on disk; for ``async_save``, also written and in place) and raises its error. A later save or load of
        the path, and interpreter exit, wait for it too; an error there is raised by the next save, load or ``wait()``.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"`fabric.save(path, state)` expects `state` to be a dict of what to save, got a"
                f" {type(state).__name__}. Name each object: `fabric.save(path, {{'model': model, 'optimizer':"
                " optimizer, 'step': step}})`."
            )
        io.state.check_filter(filter, state)

        self._validate_launched()
        location = io.CheckpointLocation.of(path)  # decided once: a local path or a URL
        location.check_reachable_by(self.world_size)
        if keep_last is not None:  # bad values fail before anything is written
            if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
                raise ValueError(f"`keep_last` must be a positive integer, got {keep_last!r}.")
            io.series.CheckpointSeries.of_member(location)
        chosen = self._checkpoint_format(checkpoint_format)
        io.background.raise_failures()  # an earlier save that failed in the background is reported now, not lost
        handle = None
        unwrapped = unwrap_objects(state, dataloaders=False)
        extra = {"checkpoint_format": chosen} if chosen is not None else {}  # a strategy of the older contract: none
        if async_save:
            handle = self._strategy.save_checkpoint_async(path=location, state=unwrapped, filter=filter, **extra)
        else:
            self._strategy.save_checkpoint(path=location, state=unwrapped, filter=filter, **extra)
        if keep_last is not None and self.is_global_zero:  # after this save is durable; its handle then covers the prune
            handle = io.background.submit(location, partial(_prune_after, handle, location, keep_last))
        self._strategy.barrier()  # from here on the checkpoint is at `location` for every rank
        if self._loggers:
            experiment_loggers.base.notify_checkpoint_saved(self._loggers, location)
        return handle if handle is not None else io.background.handle(location)

    def _checkpoint_format(self, checkpoint_format: str | CheckpointFormat | None) -> CheckpointFormat | None:
        """``fabric.save(..., checkpoint_format=...)``: a registered name becomes its format (the strategy's own
        instance where it has one of that kind); anything else is a ``TypeError``/``ValueError`` before a save."""
        if checkpoint_format is None or isinstance(checkpoint_format, io.CheckpointFormat):
            chosen = checkpoint_format
        elif isinstance(checkpoint_format, str):  # an unknown name: a ValueError listing the names, the closest first
            chosen = get_registry().create("checkpoint_format", checkpoint_format)
        else:
            raise TypeError(
                "`fabric.save(..., checkpoint_format=...)` takes the name of a registered checkpoint format (`fabric"
                f" plugins --kind checkpoint_format`) or a `CheckpointFormat`, got {type(checkpoint_format).__name__}."
            )
        return self._strategy.own_format(chosen) if chosen is not None else None

    @counts_as_progress
    @_checkpoint_section("load")
    def load(
        self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True, *, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns what the checkpoint holds beyond ``state``.

        Loading is safe by default (only tensors and plain containers); pass ``weights_only=False`` for a trusted
        checkpoint that holds arbitrary Python objects.
        """
        self._validate_launched()
        tiers = self._tiers if self._tiers is not None and self._tiers.owns(path) else None
        if tiers is None and isinstance(path, str) and path.startswith("mem://"):
            raise ValueError(
                f"{path!r} is a memory snapshot of the checkpoint tiers: create them first (`tiers ="
                " fabric.checkpoint_tiers(...)`), then `fabric.load(fabric.latest_checkpoint(tiers), state)`."
            )
        location = io.CheckpointLocation.of(path)  # decided once: a local path or a URL
        if tiers is None:
            location.check_reachable_by(self.world_size)
            io.background.wait_for_save(location)  # a save of this path still finishing here lands first
        if self.world_size > 1:
            self._strategy.barrier()  # ... and on every rank: rank 0 may still have been committing it
        if state is not None and not isinstance(state, Mapping):
            raise TypeError(
                f"`fabric.load(path, state)` expects `state` to be a dict of the objects to restore, got a"
                f" {type(state).__name__}. Use `fabric.load(path, {{'model': model, ...}})`, or"
                " `fabric.load_raw(path, model)` for a file that holds a plain state dict."
            )
        unwrapped = unwrap_objects(state, dataloaders=False) if state is not None else None
        if tiers is not None:
            remainder = tiers.load(path, unwrapped, strict=strict, weights_only=weights_only)
        else:
            remainder = self._strategy.load_checkpoint(path=location, state=unwrapped, strict=strict, weights_only=weights_only)
        self._strategy.barrier()
        if state is not None and unwrapped is not None:
            for key, value in unwrapped.items():  # plain values were replaced in the unwrapped copy
                if key in state and not isinstance(state[key], (Module, Optimizer, FabricOptimizer)) and not io.state.is_stateful(state[key]):
                    state[key] = value
        return remainder

    @_checkpoint_section("look")
    def latest_checkpoint(self, series: Any) -> str | None:
        """The newest complete checkpoint of a numbered series, the same on every rank; ``None`` before the first.

        ``series`` is the checkpoints' name with ``*`` for the number (``"ckpts/step-*.ckpt"``, ``"s3://b/run/step-*"``)
        or the path of one of them, as ``keep_last`` understands series. Global rank 0 looks and tells the others,
        so every rank resumes from the same checkpoint even while a save or a prune changes the folder. Resume with
        ``fabric.load(latest, state)``; see :mod:`fabric_core.runtime.resume` for the whole pattern.

        ``series`` may also be the checkpoint tiers (:meth:`checkpoint_tiers`): the newest checkpoint every rank can
        restore across memory, disk and remote (a collective).
        """
        if series is not None and series is self._tiers:
            self._validate_launched()
            return series.latest()
        checkpoints = io.series.CheckpointSeries.of(series)  # a series without a number is refused on every rank alike
        found: str | None = None
        error: str | None = None
        if self.is_global_zero:
            # any failure is an answer too: the other ranks must not wait for one that never comes
            location, err = utilities.guarded(checkpoints.latest)
            if err is not None:
                error = f"{type(err).__name__}: {err}"
            elif location is not None:
                found = str(location)
        if self.world_size > 1:
            self._validate_launched()
            found, error = self._strategy.broadcast((found, error), src=0)
        if error is not None:
            raise RuntimeError(f"Looking for the newest checkpoint of {str(series)!r} failed on global rank 0: {error}")
        return found

    def checkpoint_tiers(self, **options: Any) -> Any:
        """Checkpoints in memory every step (copied to a peer node), on disk and at a URL each at its own interval, and
        recovery from the fastest complete one (:class:`~fabric_core.runtime.tiers.CheckpointTiers`, whose arguments
        ``options`` are). Call on every rank, after ``launch()``::

            tiers = fabric.checkpoint_tiers(memory_every=1, disk_every=50)
            latest = fabric.latest_checkpoint(tiers)
            if latest is not None:
                fabric.load(latest, state)
            ...
            tiers.save(step, state)   # after every optimizer step
        """
        from fabric_core.runtime.tiers import CheckpointTiers

        self._validate_launched()
        if self._tiers is not None and not self._tiers.closed:
            self._tiers.close(finished=False)
        self._tiers = CheckpointTiers(self, unwrap=partial(unwrap_objects, dataloaders=False), **options)
        return self._tiers

    def load_raw(self, path: str | Path, obj: Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None) -> None:
        """Load a plain PyTorch checkpoint (a state dict) into a module or optimizer."""
        location = io.CheckpointLocation.of(path)  # decided once: a local path or a URL
        io.background.wait_for_save(location)
        obj = unwrap_objects(obj)
        if isinstance(obj, Module):
            obj = self._strategy.unwrap_module(obj)
        self._strategy.load_checkpoint(path=location, state=obj, strict=strict, weights_only=weights_only)

    # ------------------------------------------------------------------------------------------------ callbacks / logging
    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name`` on every callback that has it; keyword arguments are filtered per signature."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                rank_zero_warn(f"Skipping the callback `{type(callback).__name__}.{hook_name}` because it is not callable.")
                continue
            method(*args, **_filter_kwargs(method, kwargs))

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send metrics to every logger; tensors become Python scalars first. The strategy's own metrics
        (:meth:`Strategy.metrics`, e.g. a fault-tolerant quorum's size) go with them."""
        if not self._loggers:
            return
        metrics = convert_tensors_to_scalars(metrics)
        own = self._strategy.metrics()
        if own:
            metrics = {**own, **metrics}
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)
        if not self._goodput_at_exit:  # registered after the loggers opened (and registered their finalizers): runs first
            self._goodput_at_exit = True
            import atexit

            atexit.register(self._log_goodput_at_end)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed ``random``, numpy and torch in this process (and, by default, dataloader workers)."""
        return utilities.seed.seed_everything(seed=seed, workers=True if workers is None else workers, verbose=verbose)

    def __repr__(self) -> str:
        return (
            f"Fabric(accelerator={self._accelerator.name!r}, strategy={type(self._strategy).__name__},"
            f" precision={self._precision.precision!r}, world_size={self.world_size})"
        )


def _prune_after(save: Any, location: Any, keep_last: int) -> list[str]:
    """``keep_last``'s prune, in the background queue: only once the save it follows is durable (an async save's
    handle may come from a strategy's own machinery rather than this queue)."""
    if save is not None:
        save.wait()
    return io.retention.prune(location, keep_last)


def _filter_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (ValueError, TypeError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _check_optimizers(optimizers: Iterable[Any], where: str) -> None:
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"`{where}` expects `torch.optim.Optimizer` objects after the model, but argument {index + 1} is a"
                f" {type(optimizer).__name__}. A learning-rate scheduler goes to `scheduler=`; other objects are not"
                " set up."
            )


def _as_list(value: Any, kind: str, check: Callable[[Any], str | None]) -> list[Any]:
    """``None``, one object or a list/tuple of them, each checked (``check`` returns a complaint or ``None``)."""
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        complaint = check(item)
        if complaint:
            raise TypeError(f"`Fabric({kind}=...)` got {item!r}: {complaint}")
    return items
