"""``ModelParallelStrategy`` (``strategy="model_parallel"``): tensor parallelism and FSDP2 over a 2-D device mesh, both
applied by the user's ``parallelize_fn``.

The processes are laid out as a mesh of ``data_parallel_size`` x ``tensor_parallel_size`` named
``("data_parallel", "tensor_parallel")``: the processes of one row hold the parts of one model replica (tensor
parallel peers, which read the same batches), the rows are data-parallel replicas or shards. ``parallelize_fn(model,
mesh)`` does the sharding (``parallelize_module`` over ``mesh["tensor_parallel"]``, ``fully_shard`` over
``mesh["data_parallel"]``) and returns the model; the strategy materialises what was built on the meta device, and
everything else (meta init, ``no_backward_sync``, clipping over all shards, sharded and full checkpoints that
``fsdp`` loads too) is :class:`~fabric_fsdp.sharded.ShardedStrategy`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from fabric_core.strategies import DATA_SHARD, TENSOR, Axis, Binding
from fabric_core.utilities import load_callable
from fabric_fsdp import sharding
from fabric_fsdp.sharded import ShardedStrategy
from fabric_fsdp.sharding import is_dtensor, is_fsdp

if TYPE_CHECKING:
    from typing import Unpack

    from torch.distributed.device_mesh import DeviceMesh

    from fabric_core.accelerators import Accelerator
    from fabric_core.precision import Precision
    from fabric_core.strategies import ParallelOptions

__all__ = ["MESH_DIMENSIONS", "ModelParallelStrategy", "mesh_sizes"]

#: The names of the mesh dimensions ``parallelize_fn`` receives, outermost first.
MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")
#: Precision names the strategy runs (the reference's set); the precision plugins of those names do the casting.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def _check_size(value: Any, name: str) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"`{name}` must be 'auto' or a positive integer, got {value!r}.")


def mesh_sizes(data_parallel: int | str, tensor_parallel: int | str, num_nodes: int, processes_per_node: int) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` for the job: ``"auto"`` tensor parallel is the processes of one
    node and data parallel the nodes; one ``"auto"`` beside a number is what the world size leaves. The product must
    be the world size."""
    world = num_nodes * processes_per_node
    if tensor_parallel == "auto" and data_parallel == "auto":
        tensor_parallel, data_parallel = processes_per_node, num_nodes
    elif tensor_parallel == "auto":
        tensor_parallel = max(1, world // int(data_parallel))
    elif data_parallel == "auto":
        data_parallel = max(1, world // int(tensor_parallel))
    dp, tp = int(data_parallel), int(tensor_parallel)
    if dp * tp != world:
        raise ValueError(
            f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied should equal the world"
            f" size ({world}): {num_nodes} node(s) x {processes_per_node} device(s). Change the sizes, or `devices`"
            " and `num_nodes`."
        )
    return dp, tp


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
    """Tensor parallelism and FSDP2 on a ``(data_parallel, tensor_parallel)`` mesh, applied by ``parallelize_fn``.

    Args:
        parallelize_fn: ``fn(model, device_mesh) -> model``: shards the model over the 2-D mesh named
            ``("data_parallel", "tensor_parallel")`` and returns it; called on every rank in ``fabric.setup``. A
            callable, or an import string ``"package.module:function"`` (what a strategy registered by name, or built
            in a spawned process, can carry).
        data_parallel_size: the number of data-parallel replicas (mesh rows); ``"auto"``: the number of nodes, or
            what ``tensor_parallel_size`` leaves of the world size.
        tensor_parallel_size: the number of processes one replica is split over; ``"auto"``: the devices of a node,
            or what ``data_parallel_size`` leaves.
        save_distributed_checkpoint: ``True`` (default): a sharded folder every rank writes (DCP; loads on any number
            of processes, also into ``fsdp``); ``False``: one full file written by rank 0, readable everywhere.
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
        **options: Unpack[ParallelOptions],
    ) -> None:
        if parallelize_fn is None:
            raise ValueError(
                "The `ModelParallelStrategy` needs a `parallelize_fn(model, device_mesh)` that shards the model and"
                " returns it: `Fabric(strategy=ModelParallelStrategy(parallelize_fn=my_fn))`. A strategy registered by"
                " name takes it as an import string: `registrar.add('my_tp', 'fabric_fsdp:ModelParallelStrategy',"
                " parallelize_fn='my_package.parallel:parallelize')`."
            )
        _check_size(data_parallel_size, "data_parallel_size")
        _check_size(tensor_parallel_size, "tensor_parallel_size")
        super().__init__(state_dict_type="sharded" if save_distributed_checkpoint else "full", **options)
        self._parallelize_fn = load_callable(parallelize_fn, "parallelize_fn")
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._mesh: DeviceMesh | None = None

    # ---------------------------------------------------------------------------------------- layout
    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(data_parallel_size, tensor_parallel_size)`` as the job resolves them (``ValueError`` when their product is
        not the world size)."""
        return mesh_sizes(self._data_parallel_size, self._tensor_parallel_size, self.num_nodes, self.placement.processes_per_node)

    @property
    def tensor_parallel_size(self) -> int:
        """The mesh's columns: the processes one model replica is split over."""
        return self.mesh_shape[1]

    def parallel_axes(self) -> tuple[Axis, ...]:
        """The mesh's two dimensions: ``data_parallel`` rows (different batches; FSDP2 shards over them) and
        ``tensor_parallel`` columns (the processes one model replica is split over, which share their batches)."""
        rows, columns = self.mesh_shape
        rank = self.global_rank
        return (
            Axis(MESH_DIMENSIONS[0], rows, rank // columns, DATA_SHARD),
            Axis(MESH_DIMENSIONS[1], columns, rank % columns, TENSOR),
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(data_parallel, tensor_parallel)`` mesh ``parallelize_fn`` receives (made when the processes start)."""
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
        mesh_sizes(self._data_parallel_size, self._tensor_parallel_size, self.num_nodes, self.placement.processes_per_node)

    def setup_environment(self) -> None:
        """In every process: the process group, then the 2-D mesh over it."""
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        self._mesh = init_device_mesh(self.root_device.type, self.mesh_shape, mesh_dim_names=MESH_DIMENSIONS)

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

    # ---------------------------------------------------------------------------------------- setup
    def setup_module(self, module: Module) -> Module:
        """``parallelize_fn(module, device_mesh)``, then the meta parameters materialised and what it left whole
        moved to this process's device; refused when data-parallel replicas would never agree."""
        module = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(module, Module):
            raise TypeError(
                f"The `parallelize_fn` must return a `nn.Module` instance, but got: {type(module).__name__}. Return the"
                " model it sharded."
            )
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            seed = self.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()) if self.is_global_zero else None)
            sharding.materialize(module, self.root_device, seed)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not is_dtensor(tensor) and tensor.device != self.root_device:
                    tensor.data = tensor.data.to(self.root_device)
        self._check_data_parallel(module)
        self.track(module, [m for m in module.modules() if is_fsdp(m)])
        return module

    def _check_data_parallel(self, module: Module) -> None:
        """With more than one mesh row, a parameter not sharded or replicated over ``data_parallel`` would get a
        gradient from its own row's batches only, and the replicas would drift apart without an error."""
        if self.data_parallel_size == 1:
            return
        local = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and not (is_dtensor(p) and MESH_DIMENSIONS[0] in (p.device_mesh.mesh_dim_names or ()))
        ]
        if local:
            raise ValueError(
                f"`data_parallel_size={self.data_parallel_size}`, but `parallelize_fn` left parameters that no"
                f" data-parallel process group synchronises (e.g. {local[:3]}): their replicas would drift apart."
                " Apply `fully_shard(module, mesh=device_mesh['data_parallel'])` in `parallelize_fn` (after the tensor"
                " parallel plan), or set `data_parallel_size=1`."
            )

    def __repr__(self) -> str:
        shape = f"({self._data_parallel_size!r}, {self._tensor_parallel_size!r})"
        return f"ModelParallelStrategy(devices={self.num_processes}, num_nodes={self.num_nodes}, mesh={shape})"
