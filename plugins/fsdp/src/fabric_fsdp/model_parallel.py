"""``ModelParallelStrategy`` (``strategy="model_parallel"``): FSDP2, tensor, pipeline and sequence parallelism over
one device mesh.

The processes are laid out as a mesh named, outermost first, ``("pipeline", "data_parallel", "sequence",
"tensor_parallel")``; the pipeline and sequence dimensions are there when their size is above one, so a job without
them keeps the 2-D ``("data_parallel", "tensor_parallel")`` mesh. Tensor-parallel, sequence-parallel and pipeline
peers read the same batches; the data-parallel rows read different ones. ``parallelize_fn(model, mesh)`` does the
sharding (``parallelize_module`` over ``mesh["tensor_parallel"]``, ``fully_shard`` over ``mesh["data_parallel"]``, or
over ``mesh["data_sequence"]``, the data and sequence dimensions flattened, when there is a sequence axis) and returns
the model; with a pipeline it is called once per stage this rank holds. The strategy cuts the pipeline stages
(:mod:`fabric_fsdp.pipeline`), shards the sequence around attention (:mod:`fabric_fsdp.sequence`), materialises what
was built on the meta device, and runs a step through ``fabric.forward_backward``; everything else (meta init,
``no_backward_sync``, clipping over all shards, sharded and full checkpoints that ``fsdp`` loads too) is
:class:`~fabric_fsdp.sharded.ShardedStrategy`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.strategies import DATA_SHARD, PIPELINE, SEQUENCE, TENSOR, Axis, Binding
from fabric_core.utilities import clip_grad_norm, load_callable
from fabric_fsdp import pipeline as pipelining
from fabric_fsdp import sequence, sharding
from fabric_fsdp.checkpoint import ShardedFormat
from fabric_fsdp.sharded import ShardedStrategy
from fabric_fsdp.sharding import is_dtensor, is_fsdp

if TYPE_CHECKING:
    from typing import Unpack

    from torch.distributed.device_mesh import DeviceMesh

    from fabric_core.accelerators import Accelerator
    from fabric_core.precision import Precision
    from fabric_core.strategies import ForwardBackward, ParallelOptions

__all__ = [
    "DATA_SEQUENCE",
    "MESH_DIMENSIONS",
    "PIPELINE_DIM",
    "SEQUENCE_DIM",
    "ModelParallelStrategy",
    "mesh_layout",
    "mesh_sizes",
]

#: The names of the 2-D mesh's dimensions (data parallel rows, tensor parallel columns), outermost first.
MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")
#: The mesh's pipeline dimension (outermost) and sequence dimension (between data and tensor parallel); their
#: names are also the core's role names of those axes (``fabric_core.strategies.PIPELINE``/``SEQUENCE``).
PIPELINE_DIM, SEQUENCE_DIM = "pipeline", "sequence"
#: The data and sequence dimensions flattened into one: what FSDP shards over when there is a sequence axis, since
#: sequence peers compute gradients of the same parameters from different tokens.
DATA_SEQUENCE = "data_sequence"
#: Precision names the strategy runs (the reference's set); the precision plugins of those names do the casting.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def _check_size(value: Any, name: str, auto: bool = True) -> None:
    if (value != "auto" or not auto) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        allowed = "'auto' or a positive integer" if auto else "a positive integer"
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")


def mesh_sizes(
    data_parallel: int | str,
    tensor_parallel: int | str,
    num_nodes: int,
    processes_per_node: int,
    pipeline_parallel: int = 1,
    sequence_parallel: int = 1,
) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` for the job. Without pipeline and sequence axes, ``"auto"``
    tensor parallel is the processes of one node and data parallel the nodes; with them, both ``"auto"`` make tensor
    parallel 1 and data parallel what the model axes leave. One ``"auto"`` beside a number is what the world size
    leaves. The product of all four sizes must be the world size."""
    world = num_nodes * processes_per_node
    model_axes = pipeline_parallel * sequence_parallel
    rest = max(1, world // model_axes)
    if tensor_parallel == "auto" and data_parallel == "auto":
        tensor_parallel, data_parallel = (processes_per_node, num_nodes) if model_axes == 1 else (1, rest)
    elif tensor_parallel == "auto":
        tensor_parallel = max(1, rest // int(data_parallel))
    elif data_parallel == "auto":
        data_parallel = max(1, rest // int(tensor_parallel))
    dp, tp = int(data_parallel), int(tensor_parallel)
    if dp * tp * model_axes != world:
        model = "".join(
            f" x `{n}={v}`" for n, v in (("pipeline_parallel_size", pipeline_parallel), ("sequence_parallel_size", sequence_parallel)) if v > 1
        )
        raise ValueError(
            f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}`{model} multiplied should equal the"
            f" world size ({world}): {num_nodes} node(s) x {processes_per_node} device(s). Change the sizes, or"
            " `devices` and `num_nodes`."
        )
    return dp, tp


def mesh_layout(pipeline_parallel: int, data_parallel: int, sequence_parallel: int, tensor_parallel: int) -> list[tuple[str, int]]:
    """The mesh's ``(name, size)`` dimensions, outermost first: pipeline and sequence only when above one."""
    layout = [(PIPELINE_DIM, pipeline_parallel)] if pipeline_parallel > 1 else []
    layout.append((MESH_DIMENSIONS[0], data_parallel))
    if sequence_parallel > 1:
        layout.append((SEQUENCE_DIM, sequence_parallel))
    layout.append((MESH_DIMENSIONS[1], tensor_parallel))
    return layout


def shard_over_data(model: Module, mesh: DeviceMesh) -> Module:
    """The ``parallelize_fn`` used when none is given with a pipeline or sequence axis: FSDP2 over the data (and
    sequence) ranks when there are several, else the model as it is."""
    from torch.distributed.fsdp import fully_shard

    dimension = DATA_SEQUENCE if SEQUENCE_DIM in (mesh.mesh_dim_names or ()) else MESH_DIMENSIONS[0]
    if mesh[dimension].size() > 1:
        fully_shard(model, mesh=mesh[dimension])
    return model


def _transforms_modules_only(name: str) -> bool:
    """Whether the precision registered as ``name`` only rewrites modules (its class says so; nothing is built)."""
    from fabric_core.plugins import get_registry

    entry = get_registry().lookup("precision", name)
    if entry is None:
        return False
    try:
        return bool(getattr(entry.load(), "transforms_modules_only", False))
    except ImportError:  # its distribution is broken: refused as an unsupported name
        return False


class ModelParallelStrategy(ShardedStrategy):
    """FSDP2, tensor, pipeline and sequence parallelism on one device mesh, the sharding applied by ``parallelize_fn``.

    Args:
        parallelize_fn: ``fn(model, device_mesh) -> model``: shards the model (with a pipeline: each of this rank's
            stages) over the mesh and returns it; called on every rank in ``fabric.setup``. A callable, or an import
            string ``"package.module:function"`` (what a strategy registered by name, or built in a spawned process,
            can carry). Optional with a pipeline or sequence axis: FSDP2 over the data (and sequence) ranks.
        data_parallel_size: the number of data-parallel replicas (mesh rows); ``"auto"``: see :func:`mesh_sizes`.
        tensor_parallel_size: the number of processes a layer is split over; ``"auto"``: see :func:`mesh_sizes`.
        save_distributed_checkpoint: ``True`` (default): a sharded folder every rank writes (DCP; loads on any number
            of processes and any layout, also into ``fsdp``); ``False``: one full file written by rank 0.
        pipeline_parallel_size: the number of pipeline ranks the model's stages are spread over (1: no pipeline).
        pipeline_split: where to cut the stages: the names of the modules where stages 1, 2, ... begin (e.g.
            ``["layers.4"]``; the model's forward must be the chain of its pieces, which is checked), or
            ``fn(model, stage_index, num_stages) -> nn.Module`` building each stage from the model's submodules (or
            its import string). See :mod:`fabric_fsdp.pipeline`.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"`` (default), ``"Interleaved1F1B"`` or ``"LoopedBFS"``
            (``torch.distributed.pipelining``'s).
        pipeline_micro_batches: micro-batches per step (``fabric.forward_backward(..., micro_batches=)`` overrides
            it); default: the number of stages.
        pipeline_stages_per_rank: stages per rank: 1 for GPipe and 1F1B, 2 (default) or more for the interleaved ones.
        sequence_parallel_size: the number of ranks each sequence is split over (Ulysses; 1: none).
        sequence_dim: the dimension of the inputs and the target that holds the sequence (default 1).
        sequence_positions: the keyword by which ``forward_backward`` passes each rank's ``position_ids`` to the model
            (default ``"position_ids"``); ``None`` for a model that uses no positions.
        sequence_ignore_index: integer targets of this value do not count in the loss's mean (torch's default -100).
        sequence_sdpa: route ``F.scaled_dot_product_attention`` through the all-to-all (default ``True``); a user's
            attention function is wrapped with :func:`fabric_fsdp.sequence.ulysses` instead.
        **options: the keywords of :class:`~fabric_core.strategies.ParallelStrategy` (``process_group_backend``,
            ``timeout``, ``precision``, ...).
    """

    full_checkpoint_hint = "save_distributed_checkpoint=False"

    def __init__(
        self,
        parallelize_fn: Callable[[Module, DeviceMesh], Module] | str | None = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        *,
        pipeline_parallel_size: int = 1,
        pipeline_split: pipelining.Split | str | None = None,
        pipeline_schedule: str | None = None,
        pipeline_micro_batches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
        sequence_parallel_size: int = 1,
        sequence_dim: int = 1,
        sequence_positions: str | None = "position_ids",
        sequence_ignore_index: int | None = -100,
        sequence_sdpa: bool = True,
        **options: Unpack[ParallelOptions],
    ) -> None:
        _check_size(data_parallel_size, "data_parallel_size")
        _check_size(tensor_parallel_size, "tensor_parallel_size")
        _check_size(pipeline_parallel_size, "pipeline_parallel_size", auto=False)
        _check_size(sequence_parallel_size, "sequence_parallel_size", auto=False)
        model_axes = pipeline_parallel_size > 1 or sequence_parallel_size > 1
        if parallelize_fn is None and not model_axes:
            raise ValueError(
                "The `ModelParallelStrategy` needs a `parallelize_fn(model, device_mesh)` that shards the model and"
                " returns it: `Fabric(strategy=ModelParallelStrategy(parallelize_fn=my_fn))`. A strategy registered by"
                " name takes it as an import string: `registrar.add('my_tp', 'fabric_fsdp:ModelParallelStrategy',"
                " parallelize_fn='my_package.parallel:parallelize')`. (With `pipeline_parallel_size` or"
                " `sequence_parallel_size` above 1 it may be left out: the model is then sharded with FSDP2 over the"
                " data ranks.)"
            )
        if pipeline_parallel_size > 1 and sequence_parallel_size > 1:
            raise NotImplementedError(
                "Pipeline and sequence parallelism together are not supported yet: use `pipeline_parallel_size` or"
                " `sequence_parallel_size` (each combines with data and tensor parallelism)."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._sequence_parallel_size = sequence_parallel_size
        self._configure_pipeline(pipeline_split, pipeline_schedule, pipeline_micro_batches, pipeline_stages_per_rank)
        if pipeline_parallel_size > 1 and not save_distributed_checkpoint:
            raise ValueError(self._no_full_checkpoint())
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int) or sequence_dim < 1:
            raise ValueError(
                f"`sequence_dim` must be the inputs' sequence dimension, a positive integer (0 is the batch), got"
                f" {sequence_dim!r}."
            )
        if sequence_positions is not None and not (isinstance(sequence_positions, str) and sequence_positions.isidentifier()):
            raise ValueError(f"`sequence_positions` must be a keyword name or None, got {sequence_positions!r}.")
        self._sequence_dim = sequence_dim
        self._sequence_positions = sequence_positions
        self._sequence_ignore_index = sequence_ignore_index
        self._sequence_sdpa = bool(sequence_sdpa)
        super().__init__(state_dict_type="sharded" if save_distributed_checkpoint else "full", **options)
        self._parallelize_fn = load_callable(parallelize_fn, "parallelize_fn") if parallelize_fn is not None else None
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._mesh: DeviceMesh | None = None

    def _configure_pipeline(self, split: Any, schedule: str | None, micro_batches: int | None, per_rank: int | None) -> None:
        pp = self._pipeline_parallel_size
        if pp == 1:
            given = [n for n, v in (("pipeline_split", split), ("pipeline_schedule", schedule), ("pipeline_micro_batches",
                     micro_batches), ("pipeline_stages_per_rank", per_rank)) if v is not None]  # fmt: skip
            if given:
                raise ValueError(
                    f"{', '.join(f'`{n}`' for n in given)} given, but `pipeline_parallel_size=1`: there is no pipeline."
                    " Set `pipeline_parallel_size` to the number of pipeline ranks, or leave them out."
                )
            self._pipeline = None
            return
        if split is None:
            raise pipelining.PipelineSplitError(
                f"`pipeline_parallel_size={pp}` needs `pipeline_split`: the module names where stages 1, 2, ... begin"
                " (e.g. `['layers.4']`), or a function `fn(model, stage_index, num_stages) -> nn.Module`."
            )
        if isinstance(split, str):
            split = load_callable(split, "pipeline_split")
        schedule = pipelining.resolve_schedule(schedule or "1F1B")
        per_rank = pipelining.resolve_stages_per_rank(schedule, per_rank)
        pipelining.check_split(split, pp * per_rank, pp, per_rank)
        if micro_batches is None:
            micro_batches = pp * per_rank
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"`pipeline_micro_batches` must be a positive integer, got {micro_batches!r}.")
        pipelining.check_micro_batches(schedule, micro_batches, pp)
        self._pipeline = (split, schedule, micro_batches, per_rank)

    def _no_full_checkpoint(self) -> str:
        return (
            "A pipeline-parallel model saves sharded checkpoints only: each pipeline rank holds other parameters, so"
            " no rank could write the whole model to one file. Use `save_distributed_checkpoint=True` (the default)"
            " and turn the folder into one file with `fabric consolidate PATH`."
        )

    # ---------------------------------------------------------------------------------------- layout
    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(data_parallel_size, tensor_parallel_size)`` as the job resolves them (``ValueError`` when the product of
        all sizes is not the world size)."""
        return mesh_sizes(
            self._data_parallel_size,
            self._tensor_parallel_size,
            self.num_nodes,
            self.placement.processes_per_node,
            self._pipeline_parallel_size,
            self._sequence_parallel_size,
        )

    @property
    def layout(self) -> list[tuple[str, int]]:
        """The mesh's ``(name, size)`` dimensions, outermost first."""
        dp, tp = self.mesh_shape
        return mesh_layout(self._pipeline_parallel_size, dp, self._sequence_parallel_size, tp)

    def coordinates(self) -> dict[str, int]:
        """This process's index along each mesh dimension (ranks are laid out row-major, outermost first)."""
        rank, found = self.global_rank, {}
        for name, size in reversed(self.layout):
            rank, found[name] = divmod(rank, size)
        return {name: found[name] for name, _ in self.layout}

    @property
    def tensor_parallel_size(self) -> int:
        """The processes one layer is split over."""
        return self.mesh_shape[1]

    @property
    def pipeline_parallel_size(self) -> int:
        """The pipeline ranks the stages are spread over."""
        return self._pipeline_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks each sequence is split over."""
        return self._sequence_parallel_size

    def parallel_axes(self) -> tuple[Axis, ...]:
        """The mesh's dimensions, outermost first: ``pipeline`` (stages; there when above one), ``data_parallel`` rows
        (different batches; FSDP2 shards over them), ``sequence`` (slices of the same sequences; there when above
        one) and ``tensor_parallel`` (the processes a layer is split over). Only the rows read different data."""
        roles = {PIPELINE_DIM: PIPELINE, MESH_DIMENSIONS[0]: DATA_SHARD, SEQUENCE_DIM: SEQUENCE, MESH_DIMENSIONS[1]: TENSOR}
        coordinates = self.coordinates()
        return tuple(Axis(name, size, coordinates[name], roles[name]) for name, size in self.layout)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh ``parallelize_fn`` receives (made when the processes start)."""
        if self._mesh is None:
            raise RuntimeError(
                "The `ModelParallelStrategy` builds its device mesh when the processes start: call `fabric.launch()`"
                " first (or start the script with `fabric run`)."
            )
        return self._mesh

    def attach(self, binding: Binding) -> None:
        """Take the resolver's decisions, then check the mesh sizes against the world they make (fail before
        launching, not in every process)."""
        super().attach(binding)
        if self.mesh_shape[1] > 1 and self._parallelize_fn is None:
            raise ValueError(
                f"`tensor_parallel_size={self.mesh_shape[1]}` needs a `parallelize_fn(model, device_mesh)` that applies"
                " the tensor-parallel plan (`parallelize_module(model, device_mesh['tensor_parallel'], {...})`), or"
                " set `tensor_parallel_size=1`."
            )

    def setup_environment(self) -> None:
        """In every process: the process group, then the mesh over it (and the flattened data x sequence dimension)."""
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = zip(*self.layout)
        self._mesh = init_device_mesh(self.root_device.type, tuple(shape), mesh_dim_names=tuple(names))
        if self._sequence_parallel_size > 1:
            self._mesh[MESH_DIMENSIONS[0], SEQUENCE_DIM]._flatten(DATA_SEQUENCE)

    # ---------------------------------------------------------------------------------------- precision
    def precision_for(self, precision: str, accelerator: Accelerator) -> Precision | None:
        """The registered precision of a supported name (``parallelize_fn`` sets any FSDP mixed-precision policy),
        or of a precision that only rewrites modules (``transforms_modules_only``, e.g. float8 training: it converts
        the Linear layers before ``parallelize_fn`` shards them); other names are refused, as the reference refuses
        them."""
        if precision not in SUPPORTED_PRECISIONS and not _transforms_modules_only(precision):
            raise ValueError(
                f"The `ModelParallelStrategy` does not support `Fabric(..., precision={precision!r})`. Choose one of:"
                f" {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}."
            )
        return None

    def check_precision(self, precision: Precision | None) -> None:
        """A precision object passed as a plugin: one of the names the strategy runs, or one that only transforms
        modules; a precision that quantizes or packs the weights (bitsandbytes) is refused before anything runs,
        since ``parallelize_fn`` would shard what it packed."""
        if precision is None or precision.precision in SUPPORTED_PRECISIONS or precision.transforms_modules_only:
            return
        raise TypeError(
            f"The `ModelParallelStrategy` cannot run {precision!r}: `parallelize_fn` shards the parameters it made,"
            " and it neither is one of the precisions the strategy runs"
            f" ({', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}) nor only transforms modules (as float8 training"
            " does). Use one of those, or a strategy that keeps whole replicas (`ddp`) for quantized models."
        )

    @ShardedStrategy.state_dict_type.setter  # type: ignore[attr-defined]
    def state_dict_type(self, value: str) -> None:
        if value == "full" and self._pipeline_parallel_size > 1:
            raise ValueError(self._no_full_checkpoint())
        ShardedStrategy.state_dict_type.fset(self, value)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------------------- setup
    def _parallelize(self, module: Module) -> Module:
        fn = self._parallelize_fn or shard_over_data
        module = fn(module, self.device_mesh)
        if not isinstance(module, Module):
            raise TypeError(
                f"The `parallelize_fn` must return a `nn.Module` instance, but got: {type(module).__name__}. Return the"
                " model it sharded."
            )
        return module

    def _seed(self) -> int:
        return self.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()) if self.is_global_zero else None)

    def _to_device(self, modules: list[Module]) -> None:
        with torch.no_grad():
            for module in modules:
                for tensor in [*module.parameters(), *module.buffers()]:
                    if not is_dtensor(tensor) and tensor.device != self.root_device:
                        tensor.data = tensor.data.to(self.root_device)

    def setup_module(self, module: Module) -> Module:
        """``parallelize_fn(module, device_mesh)`` (per stage of this rank, with a pipeline), then the meta parameters
        materialised and what it left whole moved to this process's device; refused when data-parallel or sequence
        replicas would never agree."""
        if self._pipeline is not None:
            return self._setup_pipeline(module)
        module = self._parallelize(module)
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            sharding.materialize(module, self.root_device, self._seed())
        self._to_device([module])
        self._check_data_parallel(module)
        if self._sequence_parallel_size > 1:
            self._check_positions(module)
        self.track(module, [m for m in module.modules() if is_fsdp(m)])
        return module

    def _setup_pipeline(self, module: Module) -> Module:
        """Cut the stages, keep this rank's in ``module`` (the others' parts become placeholders), shard each stage
        with ``parallelize_fn``, and remember the pipeline that runs them."""
        split, schedule, micro_batches, per_rank = self._pipeline  # type: ignore[misc]
        coordinates = self.coordinates()
        stages, indices, check, full_names = pipelining.split_model(
            module,
            split,
            pipeline_rank=coordinates[PIPELINE_DIM],
            pipeline_size=self._pipeline_parallel_size,
            stages_per_rank=per_rank,
        )
        stages = [self._parallelize(stage) for stage in stages]
        replicas = [self.device_mesh.get_group(name) for name, size in self.layout if name != PIPELINE_DIM and size > 1]
        if any(t.is_meta for part in [module, *stages] for t in [*part.parameters(), *part.buffers()]):
            seed = self._seed()
            for stage in stages:  # each stage as a whole (an FSDP root), then what the model keeps outside them
                if any(t.is_meta for t in [*stage.parameters(), *stage.buffers()]):
                    sharding.materialize(stage, self.root_device, seed, replicas=replicas)
            sharding.materialize_own(module, self.root_device, seed)
        self._to_device([module, *stages])
        self._check_data_parallel(module)
        self.track(module, [m for m in [*module.modules(), *stages] if is_fsdp(m)])
        pipelining.register(
            module,
            pipelining.Pipeline(
                stages=stages,
                indices=indices,
                num_stages=self._pipeline_parallel_size * per_rank,
                schedule=schedule,
                micro_batches=micro_batches,
                group=self.device_mesh.get_group(PIPELINE_DIM),
                device=self.root_device,
                check=check,
                full_names=full_names,
            ),
        )
        return module

    def sharded_checkpoint_format(self) -> ShardedFormat:
        """The sharded folder format; for a pipeline model, each optimizer's parameter groups are completed with
        every stage's parameters (each rank lists only its own)."""

        def complete(model: Module, state: dict[str, Any]) -> dict[str, Any]:
            pipeline = pipelining.pipeline_of(model)
            return state if pipeline is None else pipeline.complete_param_groups(state)

        return ShardedFormat(owner=self.owner, stager=self.dcp_stager, complete_groups=complete)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With a pipeline, an optimizer built over the whole model keeps only this rank's parameters (the others'
        parts were removed from the model here)."""
        own = {id(p) for model in self._models if pipelining.pipeline_of(model) is not None for p in model.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if own and any(id(p) in own for p in params):
            for group in optimizer.param_groups:
                kept = [p for p in group["params"] if id(p) in own]
                for p in group["params"]:
                    if id(p) not in own:
                        optimizer.state.pop(p, None)
                group["params"][:] = kept  # in place: some optimizers keep a reference to the list
        return super().setup_optimizer(optimizer)

    def _check_data_parallel(self, module: Module) -> None:
        """With more than one data-parallel or sequence rank, a parameter not sharded or replicated over them would get
        a gradient from its own rank's tokens only, and the replicas would drift apart without an error."""
        needed = {name for name, size in self.layout if name in (MESH_DIMENSIONS[0], SEQUENCE_DIM) and size > 1}
        if not needed:
            return

        def covered(p: Tensor) -> set[str]:
            names = set(p.device_mesh.mesh_dim_names or ()) if is_dtensor(p) else set()
            return names | ({MESH_DIMENSIONS[0], SEQUENCE_DIM} if DATA_SEQUENCE in names else set())

        local = [name for name, p in module.named_parameters() if p.requires_grad and not needed <= covered(p)]
        if local:
            where = "device_mesh['data_sequence']" if SEQUENCE_DIM in needed else "device_mesh['data_parallel']"
            sizes = " and ".join(f"`{n}_size={s}`" for n, s in (("data_parallel", self.data_parallel_size),
                                 ("sequence_parallel", self._sequence_parallel_size)) if s > 1)  # fmt: skip
            raise ValueError(
                f"{sizes}, but `parallelize_fn` left parameters that no data-parallel process group synchronises over"
                f" those ranks (e.g. {local[:3]}): their replicas would drift apart. Apply `fully_shard(module,"
                f" mesh={where})` in `parallelize_fn` (after the tensor parallel plan), or leave `parallelize_fn`"
                " out to get that."
                if SEQUENCE_DIM in needed or self._parallelize_fn is None
                else f"`data_parallel_size={self.data_parallel_size}`, but `parallelize_fn` left parameters that no"
                f" data-parallel process group synchronises (e.g. {local[:3]}): their replicas would drift apart."
                " Apply `fully_shard(module, mesh=device_mesh['data_parallel'])` in `parallelize_fn` (after the tensor"
                " parallel plan), or set `data_parallel_size=1`."
            )

    def _check_positions(self, module: Module) -> None:
        name = self._sequence_positions
        if name is not None and not sequence.takes_keyword(module, name):
            raise TypeError(
                f"With `sequence_parallel_size={self._sequence_parallel_size}` each rank holds a slice of every"
                f" sequence, so positions the model computes itself (`arange(seq_len)`) would restart at 0 on every"
                f" rank. `fabric.forward_backward` passes each rank's positions as `{name}=` (shape (batch,"
                f" seq_len / {self._sequence_parallel_size})), but `{type(module).__name__}.forward` takes no such"
                f" argument. Add it to forward and use it for the positions, name the keyword your model takes with"
                " `sequence_positions=`, or set `sequence_positions=None` if the model uses no positions."
            )

    # ---------------------------------------------------------------------------------------- training step
    def forward_backward(self, step: ForwardBackward) -> Tensor:
        """A pipeline-split model: one step of its schedule over the micro-batches. With a sequence axis: the
        inputs, target and positions cut along the sequence, attention through the all-to-all, and the loss weighted
        by each rank's share of the tokens. Otherwise the default micro-batch loop."""
        pipeline = pipelining.pipeline_of(step.module)
        if pipeline is not None:
            precision = self.precision
            return pipeline.run(step, precision.convert_input, precision.forward_context)
        if self._sequence_parallel_size > 1:
            return self._sequence_step(step)
        return step.run()

    def _sequence_step(self, step: ForwardBackward) -> Tensor:
        import torch.distributed as dist

        group = self.device_mesh.get_group(SEQUENCE_DIM)
        size, rank, dim = self._sequence_parallel_size, self.coordinates()[SEQUENCE_DIM], self._sequence_dim
        length = sequence.sequence_length((step.args, dict(step.kwargs)), dim)
        if length is None:
            raise ValueError(
                f"With `sequence_parallel_size={size}`, `fabric.forward_backward` cuts the inputs along dimension"
                f" {dim} (`sequence_dim`), but no tensor input has that dimension. Pass the token tensor (batch,"
                " seq_len, ...) as an input, or set `sequence_dim`."
            )
        args, kwargs = sequence.shard_sequence((tuple(step.args), dict(step.kwargs)), length, dim, rank, size)
        target = sequence.shard_sequence(step.target, length, dim, rank, size)
        name = self._sequence_positions
        if name is not None and name not in kwargs:
            batch = next(t.shape[0] for t in [*args, *kwargs.values()] if isinstance(t, Tensor) and t.dim() > dim)
            kwargs[name] = sequence.positions(batch, length, rank, size, self.root_device)
        ignore = self._sequence_ignore_index

        def weighted(output: Any, target: Any) -> Tensor:
            return step.loss(output, target) * sequence.token_weight(target, ignore, group)

        sharded = step.with_inputs(args=args, kwargs=kwargs, target=target, loss_fn=weighted)
        with sequence.UlyssesAttention(group) if self._sequence_sdpa else contextlib.nullcontext():
            loss = sharded.run()
        dist.all_reduce(loss, group=group)
        return loss / size

    def sequence_attention(self) -> contextlib.AbstractContextManager:
        """For a loop that cuts the sequence itself: inside, ``F.scaled_dot_product_attention`` goes through the
        all-to-all (``fabric.forward_backward`` does this on its own)."""
        if self._sequence_parallel_size == 1:
            return contextlib.nullcontext()
        return sequence.UlyssesAttention(self.device_mesh.get_group(SEQUENCE_DIM))

    def ulysses(self, attention: Callable[..., Tensor], *, head_dim: int = 1, seq_dim: int = 2) -> Callable[..., Tensor]:
        """``attention`` made to attend over the whole sequence on this job's sequence axis
        (:func:`fabric_fsdp.sequence.ulysses`); the function itself when there is no sequence axis."""
        if self._sequence_parallel_size == 1:
            return attention
        return sequence.ulysses(attention, self.device_mesh.get_group(SEQUENCE_DIM), head_dim=head_dim, seq_dim=seq_dim)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int | str = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm over all shards on all ranks; with a pipeline also over every stage, so each stage clips
        by the whole model's norm."""
        if pipelining.pipeline_of(self.unwrap_module(module)) is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        group = self.device_mesh.get_group(PIPELINE_DIM)
        return clip_grad_norm(params, float(max_norm), float(norm_type), error_if_nonfinite, group=group)

    def teardown(self) -> None:
        """What the sharded strategies release, then the mesh (its process groups go with the default group)."""
        super().teardown()
        self._mesh = None

    def __repr__(self) -> str:
        shape = f"({self._data_parallel_size!r}, {self._tensor_parallel_size!r})"
        extra = "".join(
            f", {n}={v}" for n, v in (("pipeline", self._pipeline_parallel_size), ("sequence", self._sequence_parallel_size)) if v > 1
        )
        return f"ModelParallelStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, mesh={shape}{extra})"
