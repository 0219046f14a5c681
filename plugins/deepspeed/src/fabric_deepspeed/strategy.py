"""``DeepSpeedStrategy``: DeepSpeed's ZeRO engine behind the ordinary Fabric loop, on GPUs and on the CPU.

Wiring only: the process group, ranks and collectives come from the core's ``ParallelStrategy`` (DeepSpeed is
handed that group, :mod:`fabric_deepspeed.runtime`); the config is :mod:`fabric_deepspeed.config`; the precision
is :mod:`fabric_deepspeed.precision`; checkpoints are :mod:`fabric_deepspeed.checkpoint`, built on the core's
checkpoint building blocks. The README lists the choices worth knowing.

The engine owns the model *and* its optimizer, so the strategy declares the core's extension points for that:
``requires_joint_setup`` (``setup(model, optimizer)``), ``optimizer_step_target`` (``optimizer.step()`` steps the
engine that owns that optimizer) and no ``backward_sync_control`` (``no_backward_sync`` warns and does nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import CheckpointFormat, CheckpointLocation, FormatContext
from fabric_core.precision import Precision
from fabric_core.strategies import (
    DATA_REPLICATE,
    DATA_SHARD,
    Axis,
    ParallelStrategy,
    collective_timeout,
    require_precision_type,
)
from fabric_core.utilities import rank_zero_warn
from fabric_deepspeed import checkpoint as ds_checkpoint
from fabric_deepspeed import config as ds_config
from fabric_deepspeed import runtime
from fabric_deepspeed.layout import tag_folder_parent
from fabric_deepspeed.precision import SUPPORTED, DeepSpeedPrecision

if TYPE_CHECKING:
    from typing import Unpack

    from fabric_core.accelerators import Accelerator
    from fabric_core.io import CheckpointIO
    from fabric_core.strategies import ParallelOptions

__all__ = ["DeepSpeedStrategy"]

_CLIPPING = (
    "DeepSpeed handles gradient clipping automatically within the optimizer. Make sure to set the"
    " `gradient_clipping` value in your Config: `DeepSpeedStrategy(config={..., 'gradient_clipping': 1.0})` clips"
    " the global gradient norm in every `optimizer.step()`; the norm before clipping is"
    " `model.get_global_grad_norm()` afterwards."
)


def _check_precision(precision: Precision | None) -> None:
    """The engine casts, scales and steps: another strategy's precision object would bypass it."""
    require_precision_type(
        precision,
        strategy="DeepSpeed",
        name="deepspeed",
        needs=DeepSpeedPrecision,
        supported=SUPPORTED,
        reason="DeepSpeed's engine does the casting, loss scaling and stepping itself.",
    )


def _check_checkpoint_io(io: Any) -> None:
    from fabric_core.io import TorchCheckpointIO

    if io is None or type(io) is TorchCheckpointIO:
        return
    raise NotImplementedError(
        f"The `DeepSpeedStrategy` does not support setting a `CheckpointIO` plugin, got {type(io).__name__}:"
        " DeepSpeed's engine writes and reads its checkpoint directory itself, every rank its own files, so the"
        " plugin would not be used. Leave it out; to get one file, run `fabric consolidate <checkpoint>` on the"
        " saved directory and handle that file as you like."
    )


class DeepSpeedStrategy(ParallelStrategy):
    """DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) with a user's torch optimizer, in the ordinary Fabric loop.

    The keyword options are those of the well-known ``DeepSpeedStrategy``; they build its default config
    (:func:`fabric_deepspeed.config.default_config`). The README's "The reference's options" table says what each
    does here.

    Args:
        config: a DeepSpeed config dict or the path of a JSON file (default: ``PL_DEEPSPEED_CONFIG_PATH`` if set).
            Replaces every default, as in the reference; keyword options that were also set are then ignored,
            with a warning. Fabric adds what it needs without overriding your keys (see
            :func:`fabric_deepspeed.config.engine_config`).
        stage: ZeRO stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters
            (``init_module()`` then builds the model partitioned); 0 (or ``zero_optimization=False``) is plain data
            parallelism through the engine.
        offload_optimizer, offload_parameters: keep the optimizer state (stage 1-3) / parameters (stage 3) in CPU
            memory, or on NVMe with ``offload_optimizer_device``/``offload_params_device="nvme"`` and
            ``nvme_path`` (needs DeepSpeed's JIT-compiled ``async_io`` op: libaio and a C++ compiler).
        remote_device: where ``init_module()`` puts the partitioned parameters under stage 3 (``"cpu"``,
            ``"nvme"``; default: the device).
        logging_level: the level of DeepSpeed's logger (default ``logging.WARN``).
        load_full_weights: accepted for the reference's sake; loading a single-file checkpoint into a stage-3
            model works with or without it.
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of checkpoints.
        **options: the keywords of :class:`~fabric_core.strategies.ParallelStrategy` (``precision``,
            ``timeout``: how long collectives, DeepSpeed's too, wait for the other ranks; ...).
    """

    requires_joint_setup = True
    #: the reference's environment variable for a config file
    DEEPSPEED_ENV_VAR = ds_config.CONFIG_PATH_VARIABLE

    def __init__(
        self,
        *,
        zero_optimization: bool = True,
        stage: int = 2,
        remote_device: str | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        params_buffer_count: int = 5,
        params_buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int = 4,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        allgather_partitions: bool = True,
        reduce_scatter: bool = True,
        allgather_bucket_size: int = 200_000_000,
        reduce_bucket_size: int = 200_000_000,
        zero_allow_untested_optimizer: bool = True,
        logging_batch_size_per_gpu: int | None = None,
        config: str | os.PathLike | dict[str, Any] | None = None,
        logging_level: int = logging.WARN,
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        load_full_weights: bool = False,
        exclude_frozen_parameters: bool = False,
        **options: Unpack[ParallelOptions],
    ) -> None:
        super().__init__(**options)
        self.check_checkpoint_io(self.configured_checkpoint_io)
        given = dict(locals())
        options = {name: given[name] for name in ds_config.OPTION_DEFAULTS}
        ds_config.check_options(options)
        self.fp16_options = {name: given[name] for name in ds_config.FP16_OPTION_DEFAULTS}
        self.remote_device = remote_device
        self.logging_level = logging_level
        self.load_full_weights = load_full_weights
        self.exclude_frozen_parameters = exclude_frozen_parameters
        #: The DeepSpeed config: as configured until the processes are set up, then what the engines get.
        self.config, ignored = ds_config.user_config(config, options)
        if ignored:
            rank_zero_warn(
                f"`DeepSpeedStrategy(config=...)` replaces the options built from keyword arguments, so"
                f" {', '.join(f'`{n}`' for n in ignored)} {'is' if len(ignored) == 1 else 'are'} ignored (as in the"
                " reference). Put them into the config instead."
            )
        self._config_ready = False
        self._deepspeed: ModuleType | None = None
        self._engines: list[Any] = []
        self._current: Any = None
        self.optimizer_step_target = self._engine_of_optimizer

    # ---------------------------------------------------------------------------------------- plugins
    def default_precision(self) -> Precision:
        return DeepSpeedPrecision("32-true")

    def check_precision(self, precision: Precision | None) -> None:
        _check_precision(precision)

    def precision_for(self, precision: str, accelerator: Accelerator) -> Precision | None:
        """A ``DeepSpeedPrecision`` (the engine's own casting); names DeepSpeed cannot run are a ``ValueError``."""
        if accelerator.device_type == "cpu" and precision in ("16-mixed", "16-true"):
            raise ValueError(
                f"`precision={precision!r}` is not supported by DeepSpeed on the CPU (its fp16 needs a GPU). Use"
                " `precision='bf16-mixed'` (or 'bf16-true') on the CPU."
            )
        return DeepSpeedPrecision(precision)  # ValueError with the supported names for anything else

    def check_checkpoint_io(self, io: CheckpointIO | None) -> None:
        _check_checkpoint_io(io)

    # ---------------------------------------------------------------------------------------- config
    @property
    def zero_stage(self) -> int:
        return ds_config.zero_stage(self.config)

    def parallel_axes(self) -> tuple[Axis, ...]:
        """One data-parallel axis over the world: ``data_shard`` under ZeRO stages 1-3 (optimizer state, gradients
        or parameters partitioned over it), ``data_replicate`` at stage 0."""
        if self.world_size <= 1:
            return ()
        if self.zero_stage == 0:
            return (Axis("data_replicate", self.world_size, self.global_rank, DATA_REPLICATE),)
        return (Axis("data_shard", self.world_size, self.global_rank, DATA_SHARD),)

    @property
    def zero_stage_3(self) -> bool:
        return self.zero_stage == 3

    @property
    def model(self) -> Any:
        """The engine set up last, or passed to ``fabric.backward(..., model=...)`` last (the reference's attribute)."""
        return self._current

    @property
    def engines(self) -> list[Any]:
        """The DeepSpeed engines this strategy set up, in order."""
        return list(self._engines)

    def _prepare(self) -> ModuleType:
        """Import DeepSpeed for this device, finish the config, join our process group (once, on every rank)."""
        if self._deepspeed is not None:
            return self._deepspeed
        if not self.process_group_ready():
            raise RuntimeError(
                "The DeepSpeed strategy needs its processes before a model is set up: call `fabric.launch()` first"
                " (or start the script with `fabric run`)."
            )
        self._export_rank_variables()
        deepspeed = runtime.import_deepspeed(self.root_device.type, self.logging_level)
        if not self._config_ready:
            self.config = ds_config.engine_config(
                self.config, self.precision.precision, self.root_device.type, self.fp16_options
            )
            self._config_ready = True
        self._check_nvme(deepspeed)
        runtime.init_distributed(deepspeed, self.get_process_group_backend(), collective_timeout(self.timeout), self.world_size)
        self._deepspeed = deepspeed
        return deepspeed

    def _export_rank_variables(self) -> None:
        """DeepSpeed's engine reads ``LOCAL_RANK`` (and its tools the others) from the environment, as the reference
        exports them."""
        env = self.cluster_environment
        if env is None:
            return
        self.placement.export(env.main_address, env.main_port, ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"))

    def _check_nvme(self, deepspeed: ModuleType) -> None:
        """NVMe offload needs DeepSpeed's ``async_io`` op; say what is missing before DeepSpeed spends a minute."""
        paths = ds_config.nvme_paths(self.config)
        if not paths and self.remote_device != "nvme":
            return
        for path in paths or [ds_config.OPTION_DEFAULTS["nvme_path"]]:
            if not os.path.isdir(path) or not os.access(path, os.W_OK):
                raise ValueError(
                    f"NVMe offload writes to `nvme_path={path!r}`, which is not a writable directory here. Pass"
                    " `DeepSpeedStrategy(nvme_path=...)` (or the config's `nvme_path`) naming a folder on a fast local"
                    " disk."
                )
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError(
                "NVMe offload needs DeepSpeed's `async_io` op, which cannot be built here: it needs libaio (Debian/"
                "Ubuntu: `apt-get install libaio-dev`) and a C++ compiler; DeepSpeed then JIT-compiles the op the first"
                " time it is used (about 2.5 minutes on 2 cores, cached in ~/.cache/torch_extensions afterwards). Use"
                " `deepspeed_stage_3_offload` (CPU memory) instead, or install libaio."
            )

    # ---------------------------------------------------------------------------------------- lifecycle
    def setup_environment(self) -> None:
        super().setup_environment()
        self._prepare()

    def teardown(self) -> None:
        owned = self.owns_process_group
        self._engines.clear()
        self._current = None
        super().teardown()
        if owned:
            runtime.release_groups()  # DeepSpeed's references to the destroyed groups; a later engine makes new ones
            self._deepspeed = None

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Under ZeRO stage 3, ``deepspeed.zero.Init``: every parameter is partitioned as soon as its module is built,
        so no rank ever holds the whole model."""
        if self.zero_stage_3 and empty_init is False:
            raise NotImplementedError(
                f"`empty_init={empty_init!r}` is not a valid choice with `DeepSpeedStrategy` when ZeRO stage 3 is"
                " enabled: the parameters are partitioned as their modules are built (`deepspeed.zero.Init`). Leave"
                " `empty_init` out."
            )
        stack = ExitStack()
        if not self.zero_stage_3:
            stack.enter_context(super().module_init_context(empty_init=empty_init))
        stack.enter_context(self.module_sharded_context())
        return stack

    def module_sharded_context(self) -> AbstractContextManager:
        if not self.zero_stage_3:
            return nullcontext()
        deepspeed = self._prepare()
        return deepspeed.zero.Init(
            enabled=True, remote_device=self.remote_device, config_dict_or_path=copy.deepcopy(self.config)
        )

    # ---------------------------------------------------------------------------------------- setup
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Any], Any]:
        """Build the engine for ``module`` with its optimizer (and scheduler, which the engine then steps).

        Returns the engine, ``[engine.optimizer]`` (DeepSpeed's ZeRO optimizer wrapping yours) and the scheduler.
        """
        if len(optimizers) != 1:
            raise ValueError(
                f"Currently only one optimizer is supported with DeepSpeed. Got {len(optimizers)} optimizers instead."
                " Put all parameter groups into one optimizer, or set up each model with its own optimizer."
            )
        if isinstance(self.config.get("optimizer"), dict):
            rank_zero_warn(
                "The DeepSpeed config defines an `optimizer`, but `fabric.setup` was given one: DeepSpeed uses the"
                " optimizer passed to `setup` and ignores the config's. Remove one of them."
            )
        engine = self._initialize_engine(module, self.config, optimizer=optimizers[0], scheduler=scheduler)
        return engine, [engine.optimizer], engine.lr_scheduler if scheduler is not None else None

    def setup_module(self, module: Module) -> Module:
        """An engine without an optimizer (evaluation, inference). Under ZeRO stage 3 the parameters are partitioned
        and gathered for each forward; stages 0-2 partition only optimizer state and gradients, so the engine is
        built without ZeRO (DeepSpeed refuses ZeRO 1/2 without an optimizer)."""
        cfg = self.config
        if not self.zero_stage_3:
            cfg = {k: v for k, v in cfg.items() if k not in ("zero_optimization", "optimizer", "scheduler")}
        return self._initialize_engine(module, cfg)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError(
            "The `DeepSpeedStrategy` requires the model and optimizer(s) to be set up jointly through"
            " `.setup(model, optimizer, ...)`. For inference, choose `.setup_module(model)` instead."
        )

    def _initialize_engine(self, module: Module, cfg: dict[str, Any], optimizer: Any = None, scheduler: Any = None) -> Any:
        deepspeed = self._prepare()
        engine, *_ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            model_parameters=[p for p in module.parameters() if p.requires_grad] if optimizer is None else None,
            config=copy.deepcopy(cfg),
            dist_init_required=False,
        )
        self._configure_activation_checkpointing(deepspeed)
        self._engines.append(engine)
        self._current = engine
        return engine

    def _configure_activation_checkpointing(self, deepspeed: ModuleType) -> None:
        """As the reference: the config's ``activation_checkpointing`` section configures
        ``deepspeed.checkpointing`` for models that wrap their forward functions in it."""
        section = self.config.get("activation_checkpointing")
        if not isinstance(section, dict) or not any(section.values()):
            return
        deepspeed.checkpointing.configure(
            mpu_=None,
            partition_activations=section.get("partition_activations"),
            contiguous_checkpointing=section.get("contiguous_memory_optimization"),
            checkpoint_in_cpu=section.get("cpu_checkpointing"),
            profile=section.get("profile"),
        )

    def module_to_device(self, module: Module) -> None:
        if self.zero_stage_3 and any(hasattr(p, "ds_id") for p in module.parameters()):
            return  # partitioned by `init_module`: DeepSpeed places the partitions
        super().module_to_device(module)

    def unwrap_module(self, module: Module) -> Module:
        return module.module if runtime.is_engine(module) else module

    def engine_of(self, module: Module) -> Any:
        """The engine that holds ``module`` (the engine itself, or the user's module inside it)."""
        for engine in self._engines:
            if module is engine or module is engine.module:
                return engine
        raise ValueError(
            f"The model ({type(module).__name__}) was not set up with this DeepSpeed strategy. Set it up with"
            " `model, optimizer = fabric.setup(model, optimizer)` first, and pass the model `setup` returned."
        )

    def _engine_of_optimizer(self, optimizer: Any) -> Any:
        """``optimizer_step_target``: the engine that owns ``optimizer`` (its ZeRO optimizer or the one you made)."""
        for engine in self._engines:
            own = engine.optimizer
            if own is not None and (optimizer is own or optimizer is getattr(own, "optimizer", None)):
                return engine
        raise ValueError(
            "This optimizer does not belong to a model set up with the DeepSpeed strategy, so there is no engine to"
            " step. Set up the model and the optimizer together: `model, optimizer = fabric.setup(model, optimizer)`."
        )

    # ---------------------------------------------------------------------------------------- training step
    def _backward_engine(self, module: Module | None) -> Any:
        if module is None:
            if not self._engines:
                raise RuntimeError("No models were set up for backward. Did you forget to call `fabric.setup()`?")
            if len(self._engines) > 1:
                raise ValueError(
                    "When using multiple models + deepspeed, please provide the model used to perform the"
                    " optimization: `self.backward(loss, model=model)`"
                )
            return self._engines[0]
        engine = self.engine_of(module)
        self._current = engine
        return engine

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``engine.backward(loss)``: the engine scales the loss (fp16) and reduces/partitions the gradients."""
        engine = self._backward_engine(module)
        tensor = self.precision.pre_backward(tensor, engine)
        self.precision.backward(tensor, engine, *args, **kwargs)
        self.precision.post_backward(tensor, engine)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        raise NotImplementedError(_CLIPPING)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise NotImplementedError(_CLIPPING)

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_format(self) -> CheckpointFormat:
        """DeepSpeed's checkpoint folder, written by every rank's engine, committed by the core
        (:class:`~fabric_deepspeed.checkpoint.DeepSpeedFormat`)."""
        return ds_checkpoint.DeepSpeedFormat(
            zero_stage=self.zero_stage, exclude_frozen_parameters=self.exclude_frozen_parameters
        )

    def checkpoint_formats(self) -> list[CheckpointFormat]:
        """DeepSpeed folders (through the engine), then single files (full weights into the engine)."""
        return [self.checkpoint_format(), *super().checkpoint_formats()]

    def checkpoint_context(self) -> FormatContext:
        """The core's context with DeepSpeed's adapters: full weights go into the engine (and its float32 master
        weights); a plain optimizer state dict is refused for a ZeRO optimizer before anything is loaded."""
        engines = self.engines
        return dataclasses.replace(
            super().checkpoint_context(),
            load_module_state=lambda module, state, strict: ds_checkpoint.load_module_state(engines, module, state, strict),
            load_optimizer_state=lambda optimizer, state: ds_checkpoint.load_optimizer_state(engines, optimizer, state),
            check_restore=ds_checkpoint.check_restorable,
        )

    def load_checkpoint(
        self,
        path: CheckpointLocation | str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a DeepSpeed directory (the engine reads it), a single file or another
        plugin's directory (full weights into the engine); returns what the checkpoint holds beyond ``state``."""
        location = CheckpointLocation.of(path)
        if ds_checkpoint.is_deepspeed_optimizer(state):
            raise NotImplementedError(ds_checkpoint.ZERO_OPTIMIZER_STATE_ERROR)
        if not isinstance(state, (Module, Optimizer)) and not state:
            raise ValueError(
                f"Got DeepSpeedStrategy.load_checkpoint(..., state={state!r}) but a state with at least  a model"
                " instance to reload is required. Pass it in like so: DeepSpeedStrategy.load_checkpoint(...,"
                " state={'model': model, ...})"
            )
        parent = tag_folder_parent(location)
        if parent is not None:
            raise FileNotFoundError(
                f"The provided path is not a valid DeepSpeed checkpoint: {str(location)!r}. It is the"
                f" {location.name!r} folder inside one; load the directory that holds it instead: {str(parent)!r}."
            )
        return super().load_checkpoint(location, state, strict, weights_only)

    def __repr__(self) -> str:
        return f"DeepSpeedStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, stage={self.zero_stage})"
