"""The pipeline axis of ``model_parallel``: the model cut into stages, run by a ``torch.distributed.pipelining`` schedule.

The user says where to cut (``pipeline_split``), either

* **module names** where stages begin, such as ``["layers.2"]``: the model is read as the chain of its *pieces* (the
  children of every module on the way to a split point, in the order they were registered), and a stage runs
  ``x = piece(x)`` over its pieces. Whether the model's own ``forward`` is exactly that chain is checked on the first
  step, on the meta device (:class:`ChainCheck`), so a forward that does more between pieces fails instead of
  training a different function; or
* **a function** ``fn(model, stage_index, num_stages) -> nn.Module`` that builds each stage from the model's own
  submodules (not copies), for a forward that is not a chain.

Rank ``r`` of the ``pipeline`` mesh dimension holds stages ``r, r + pp, ...`` (one per rank for GPipe and 1F1B, two
for the interleaved schedules). The model the user set up keeps only those stages' parts (the others are replaced by
:class:`Elsewhere` placeholders, so their memory is freed), which keeps every parameter under the full model's name:
sharded checkpoints from any layout load into any other. Everything here is a free function over explicit arguments;
:class:`~fabric_fsdp.model_parallel.ModelParallelStrategy` is the recipe.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from fabric_core.utilities import apply_to_collection, rank_zero_warn

if TYPE_CHECKING:
    from fabric_core.strategies import ForwardBackward

#: The schedules offered, by the name users give (case-insensitive), with the number of stages each rank holds by
#: default and whether the schedule needs at least as many micro-batches as the pipeline has ranks.
SCHEDULES: dict[str, tuple[str, int]] = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "LoopedBFS": ("ScheduleLoopedBFS", 2),
}

#: What ``pipeline_split`` may be: module names where stages 1, 2, ... begin, or ``fn(model, stage_index, num_stages)``.
Split = Sequence[str] | Callable[[Module, int, int], Module]


class PipelineSplitError(ValueError):
    """``pipeline_split`` does not describe the stages the pipeline needs (count, names, order, coverage)."""


class MicroBatchError(ValueError):
    """The number of micro-batches does not suit the schedule or the batch."""


# ----------------------------------------------------------------------------------------------------- configuration
def resolve_schedule(name: Any) -> str:
    """The schedule's canonical name (``"1f1b"`` -> ``"1F1B"``); ``ValueError`` listing the names otherwise."""
    if isinstance(name, str):
        for known in SCHEDULES:
            if known.lower() == name.lower():
                return known
    raise ValueError(
        f"Unknown `pipeline_schedule={name!r}`. Choose one of {', '.join(repr(n) for n in SCHEDULES)}"
        " (torch.distributed.pipelining's schedules of those names)."
    )


def is_multi_stage(schedule: str) -> bool:
    """Whether the schedule runs several stages per rank (the interleaved/looped ones)."""
    return SCHEDULES[schedule][1] > 1


def resolve_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """The stages each rank holds: the schedule's default, or the user's number if the schedule can run it."""
    if stages_per_rank is None:
        return SCHEDULES[schedule][1]
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"`pipeline_stages_per_rank` must be a positive integer, got {stages_per_rank!r}.")
    if not is_multi_stage(schedule) and stages_per_rank != 1:
        multi = [n for n in SCHEDULES if is_multi_stage(n)]
        raise ValueError(
            f"`pipeline_schedule={schedule!r}` runs one stage per rank, but `pipeline_stages_per_rank={stages_per_rank}`."
            f" Use an interleaved schedule ({', '.join(repr(n) for n in multi)}) for several stages per rank, or leave"
            " `pipeline_stages_per_rank` out."
        )
    if is_multi_stage(schedule) and stages_per_rank < 2:
        raise ValueError(
            f"`pipeline_schedule={schedule!r}` interleaves several stages per rank, but"
            f" `pipeline_stages_per_rank={stages_per_rank}`. Give 2 or more, or use 'GPipe'/'1F1B' for one stage per rank."
        )
    return stages_per_rank


def check_split(split: Any, num_stages: int, pipeline_size: int, stages_per_rank: int) -> None:
    """Refuse, at construction, a ``pipeline_split`` that cannot give ``num_stages`` stages."""
    if callable(split) and not isinstance(split, str):
        return
    if isinstance(split, str) or not isinstance(split, Sequence) or not all(isinstance(n, str) and n for n in split):
        raise PipelineSplitError(
            "`pipeline_split` must be the module names where stages 1, 2, ... begin (e.g. `['layers.4']`), or a"
            f" function `fn(model, stage_index, num_stages) -> nn.Module`; got {split!r}."
        )
    if len(split) + 1 != num_stages:
        example = ", ".join(f"'layers.{i}'" for i in range(1, num_stages))
        raise PipelineSplitError(
            f"`pipeline_split` has {len(split)} split point(s), so it cuts the model into {len(split) + 1} stage(s),"
            f" but the pipeline runs {num_stages}: `pipeline_parallel_size={pipeline_size}` x {stages_per_rank} stage(s)"
            f" per rank. Give {num_stages - 1} module name(s) where stages 1..{num_stages - 1} begin (e.g. [{example}]),"
            " or change `pipeline_parallel_size`/`pipeline_stages_per_rank`."
        )
    if len(set(split)) != len(split):
        raise PipelineSplitError(f"`pipeline_split` names a module twice: {list(split)}.")


def check_micro_batches(schedule: str, micro_batches: int, pipeline_size: int) -> None:
    """Refuse a number of micro-batches the schedule cannot run, saying which numbers it can."""
    if schedule == "1F1B" and micro_batches < pipeline_size:
        raise MicroBatchError(
            f"The 1F1B schedule needs at least as many micro-batches as pipeline ranks ({pipeline_size}), got"
            f" {micro_batches}. Use `micro_batches>={pipeline_size}` (more shrink the bubble: (p-1)/(m+p-1) of the"
            " time), or the 'GPipe' schedule."
        )
    if is_multi_stage(schedule):
        rounds = max(1, micro_batches // pipeline_size)
        if micro_batches % rounds:
            good = [m for m in range(pipeline_size, 4 * pipeline_size + 1) if m % max(1, m // pipeline_size) == 0]
            raise MicroBatchError(
                f"The {schedule} schedule runs the micro-batches in rounds of the pipeline's size ({pipeline_size}):"
                f" {micro_batches} micro-batches make {rounds} round(s) that do not divide them. Use a number of"
                f" micro-batches that does, e.g. one of {good}."
            )


def stage_indices(pipeline_rank: int, pipeline_size: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pipeline_rank`` holds: ``r, r + pp, r + 2 pp, ...`` (the looped layout)."""
    return [pipeline_rank + k * pipeline_size for k in range(stages_per_rank)]


# ----------------------------------------------------------------------------------------------------- stages
class Elsewhere(Module):
    """Stands where a part of the model was that another pipeline rank holds: no parameters, and no forward."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.held_name = name
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"`{self.held_name}` belongs to pipeline stage {self.stage}, held by another rank: this rank cannot run it."
        )

    def extra_repr(self) -> str:
        return f"stage={self.stage}"


#: Containers a stage mirrors by their own type (a stage's ``layers`` iterates like the model's); others by ``Module``.
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


class Chain(Module):
    """One stage of a split by module names: its pieces at their own paths (``layers.2`` stays ``layers.2``, inside a
    container of the model's container type, so a plan written for the model, such as ``fully_shard`` per layer or a
    tensor-parallel plan, applies to the stage), run as ``x = piece(x)`` in the model's order."""

    def __init__(self, model: Module, pieces: Sequence[tuple[str, Module]]) -> None:
        super().__init__()
        for name, piece in pieces:
            *path, leaf = name.split(".")
            parent: Module = self
            for depth, part in enumerate(path):
                if part not in parent._modules:
                    original = model.get_submodule(".".join(path[: depth + 1]))
                    parent.add_module(part, type(original)() if type(original) in _CONTAINERS else Module())
                parent = parent._modules[part]  # type: ignore[assignment]
            parent.add_module(leaf, piece)
        self.__dict__["pieces"] = tuple(piece for _, piece in pieces)  # the order; not registered a second time

    def forward(self, x: Any) -> Any:
        for piece in self.__dict__["pieces"]:
            x = piece(x)
        return x


def _pieces(model: Module, split: Sequence[str]) -> list[tuple[str, Module]]:
    """The model's pieces in order: the children of the root and of every module on the way to a split point."""
    cut = {""}
    for name in split:
        parts = name.split(".")
        cut.update(".".join(parts[:i]) for i in range(1, len(parts)))
    pieces: list[tuple[str, Module]] = []

    def walk(prefix: str, module: Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in cut:
                walk(full + ".", child)
            else:
                pieces.append((full, child))

    walk("", model)
    return pieces


def stages_by_names(model: Module, split: Sequence[str]) -> tuple[list[Module], list[str]]:
    """``Chain`` stages cut at the named modules, and the names of every piece in order (for :class:`ChainCheck`)."""
    pieces = _pieces(model, split)
    names = [n for n, _ in pieces]
    modules = dict(model.named_modules())
    starts = []
    for name in split:
        if name not in modules:
            raise PipelineSplitError(
                f"`pipeline_split` names {name!r}, which is not a submodule of {type(model).__name__}. Pick names from"
                f" `model.named_modules()`, e.g. {names[1:4]}."
            )
        if name not in names:
            raise PipelineSplitError(
                f"`pipeline_split` names {name!r} and one of its submodules: a stage can only begin at one of them."
            )
        starts.append(names.index(name))
    if starts != sorted(starts) or starts[0] == 0:
        raise PipelineSplitError(
            f"`pipeline_split` must name modules in the order the model runs them, after its first piece"
            f" ({names[0]!r}), each starting the next stage; got {list(split)}; the model's pieces are {names}."
        )
    for cut_name in {".".join(n.split(".")[:i]) for n in split for i in range(len(n.split(".")))}:
        own = list(modules[cut_name]._parameters)
        if own:
            raise PipelineSplitError(
                f"`{cut_name or type(model).__name__}` holds parameters itself ({own[:3]}) and the split runs through"
                " it, so they would belong to no stage. Move them into a submodule, or split with a function"
                " `pipeline_split=fn(model, stage_index, num_stages)`."
            )
    bounds = [0, *starts, len(pieces)]
    return [Chain(model, pieces[a:b]) for a, b in zip(bounds, bounds[1:])], names


def stages_by_function(model: Module, split: Callable[[Module, int, int], Module], num_stages: int) -> list[Module]:
    """Every stage, as ``split(model, stage_index, num_stages)`` builds it; each must be a module."""
    stages = []
    for index in range(num_stages):
        stage = split(model, index, num_stages)
        if not isinstance(stage, Module):
            raise PipelineSplitError(
                f"`pipeline_split` must return the stage as an `nn.Module`, but for stage {index} of {num_stages} it"
                f" returned {type(stage).__name__}. Build it from the model's submodules, e.g."
                " `nn.Sequential(*model.layers[a:b])`."
            )
        stages.append(stage)
    return stages


def check_stages(model: Module, stages: Sequence[Module]) -> None:
    """Every parameter of the model in exactly one stage, and every parameter of a stage the model's own."""
    all_names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(n)
    names = {i: f"`{n[0]}`" + "".join(f" (also `{other}`)" for other in n[1:]) for i, n in all_names.items()}
    owner: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for p in stage.parameters():
            if id(p) not in names:
                raise PipelineSplitError(
                    f"Stage {index} holds a parameter that is not one of the model's own (shape {tuple(p.shape)}):"
                    " `pipeline_split` must build stages from the model's submodules, not from copies, so that they"
                    " train the model's parameters and save them under its names."
                )
            if owner.setdefault(id(p), index) != index:
                raise PipelineSplitError(
                    f"The parameter {names[id(p)]} is in stage {owner[id(p)]} and in stage {index} (tied weights?)."
                    " A parameter can live on one pipeline stage only: untie it (e.g. give the output layer its own"
                    " weight), or put the modules that share it in one stage."
                )
    missing = [n[0] for i, n in all_names.items() if i not in owner]
    if missing:
        raise PipelineSplitError(
            f"The stages leave out parameters of the model ({missing[:4]}{' ...' if len(missing) > 4 else ''}): they"
            " would neither train nor be saved. Put every module with parameters into a stage."
        )


def prune(model: Module, keep: set[int], stage_of: dict[int, int]) -> None:
    """Keep only what this rank's stages hold: each largest submodule whose parameters are all elsewhere becomes an
    :class:`Elsewhere`, and parameters of kept modules that live elsewhere are removed (in place)."""

    def visit(prefix: str, module: Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            params = list(child.parameters())
            if not params or any(id(p) in keep for p in params):
                if params and not all(id(p) in keep for p in params):
                    visit(f"{prefix}{name}.", child)
                continue
            module._modules[name] = Elsewhere(f"{prefix}{name}", stage_of.get(id(params[0]), -1))
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in keep:
                del module._parameters[name]

    visit("", model)


def refuse_forward(model: Module) -> None:
    """A direct ``model(x)`` of a pipeline-parallel model raises, saying how it runs instead."""

    def hook(module: Module, args: Any) -> None:
        raise TypeError(
            "This model is split into pipeline stages over processes, and this rank holds only some of them: it runs"
            " through `loss = fabric.forward_backward(model, x, target=y, loss_fn=...)` (forward and backward of one"
            " step, on every rank, with the same batch), not `model(x)`."
        )

    model.register_forward_pre_hook(hook)


# ----------------------------------------------------------------------------------------------------- the chain check
def clone_on_meta(model: Module) -> Module | None:
    """A copy of the model's structure with every tensor on the meta device (no memory); ``None`` if it cannot be
    copied."""
    memo: dict[int, Any] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for _, b in model.named_buffers(remove_duplicate=False):
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # a module holding something that does not copy: the check is skipped, with a warning
        return None


@dataclass
class ChainCheck:
    """Whether the model's forward is the chain of its pieces (what a split by names runs), on a meta-device copy:
    each piece called once, in order, on exactly the previous piece's output (not a changed copy of it), and the
    model returning the last piece's output. Run once, on the first step's first micro-batch."""

    clone: Module | None
    piece_names: list[str]

    def verify(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs or len(args) != 1:
            raise PipelineSplitError(
                "A pipeline split by module names runs each stage as `x = piece(x)`, so the model takes one input,"
                f" but `fabric.forward_backward` got {len(args)} positional and {len(kwargs)} keyword input(s). Pass"
                " one tensor, or split with a function `pipeline_split=fn(model, stage_index, num_stages)` whose"
                " stages take what the previous stage returns."
            )
        if self.clone is None:
            rank_zero_warn(
                "The model could not be copied to the meta device, so whether its forward is the chain of its pieces"
                " that a pipeline split by names runs was not checked. Make sure it only calls its pieces in order."
            )
            return
        problem = self._problem(args[0])
        self.clone = None  # once is enough; free the copy
        if problem:
            raise PipelineSplitError(
                f"The model's forward is not the chain of its pieces {self.piece_names} that a pipeline split by module"
                f" names runs: {problem}. Each stage would compute something else than the model. Split with a"
                " function `pipeline_split=fn(model, stage_index, num_stages) -> nn.Module` that builds each stage"
                " with the right forward, or make the forward a chain (e.g. move code between pieces into a module)."
            )

    def _problem(self, x: Any) -> str | None:
        assert self.clone is not None
        modules = [self.clone.get_submodule(n) for n in self.piece_names]
        pieces = {m: i for i, m in enumerate(modules)}
        calls: list[tuple[int, Any, int, Any, int]] = []
        pending: dict[int, tuple[Any, int]] = {}

        def pre(module: Module, args: Any, kwargs: Any) -> None:
            first = args[0] if args else None
            extra = len(args) != 1 or bool(kwargs)
            pending[id(module)] = (None if extra else first, getattr(first, "_version", 0))

        def post(module: Module, args: Any, kwargs: Any, output: Any) -> None:
            got, version = pending.pop(id(module))
            calls.append((pieces[module], got, version, output, getattr(output, "_version", 0)))

        handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in pieces]
        handles += [m.register_forward_hook(post, with_kwargs=True) for m in pieces]
        meta_input = apply_to_collection(x, Tensor, lambda t: torch.empty_like(t, device="meta"))
        try:
            with torch.no_grad():
                output = self.clone(meta_input)
        except Exception as error:  # user code that needs real values: say so, do not fail the run
            rank_zero_warn(
                "Whether the model's forward is the chain of its pieces (what a pipeline split by names runs) could"
                f" not be checked on the meta device ({type(error).__name__}: {error}). Make sure it only calls its"
                " pieces in order."
            )
            return None
        finally:
            for h in handles:
                h.remove()
        names = self.piece_names
        order = [c[0] for c in calls]
        if order != sorted(set(order)):
            return f"it calls the pieces in the order {[names[i] for i in order]}"
        skipped = [names[i] for i, m in enumerate(modules) if i not in order and any(True for _ in m.parameters())]
        if skipped:
            return f"it never calls {skipped}"
        previous, previous_version = meta_input, getattr(meta_input, "_version", 0)
        for index, got, version, out, out_version in calls:
            if got is None:
                return f"`{names[index]}` is called with more than one input"
            if got is not previous:
                where = "the model's input" if previous is meta_input else "the previous piece's output"
                return f"`{names[index]}` receives something computed from {where}, not {where} itself"
            if version != previous_version:
                return f"the input of `{names[index]}` is changed in place before it is called"
            previous, previous_version = out, out_version
        if output is not previous or getattr(output, "_version", 0) != previous_version:
            return "it returns something computed from the last piece's output, not that output"
        return None


# ----------------------------------------------------------------------------------------------------- running
def _signature(obj: Any) -> tuple[Any, ...]:
    found: list[Any] = []
    apply_to_collection(obj, Tensor, lambda t: found.append((tuple(t.shape), t.dtype)))
    return tuple(found)


@dataclass
class Pipeline:
    """This rank's stages of one set-up model and the schedule that runs them.

    Stages and schedule are built for the micro-batches' shapes (``torch.distributed.pipelining`` fixes the shapes
    of what stages send at their first step), so a batch of another shape or count builds new ones over the same
    modules.
    """

    stages: list[Module]
    indices: list[int]
    num_stages: int
    schedule: str
    micro_batches: int
    group: Any
    device: torch.device
    check: ChainCheck | None = None
    #: The whole model's parameter names in its own order (for optimizer states that list every stage's parameters).
    full_names: list[str] = field(default_factory=list)
    _built: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    _step: ForwardBackward | None = field(default=None, repr=False)

    @property
    def pipeline_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def holds_first(self) -> bool:
        return 0 in self.indices

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def _loss(self, output: Any, target: Any) -> Tensor:
        assert self._step is not None
        return self._step.loss(output, target)

    def _schedule_for(self, key: tuple[Any, ...], micro_batches: int) -> Any:
        if key not in self._built:
            from torch.distributed import pipelining

            if len(self._built) >= 4:  # a few shapes at a time (e.g. a last, smaller batch); rebuild others
                self._built.pop(next(iter(self._built)))
            stages = [
                pipelining.PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                for module, index in zip(self.stages, self.indices)
            ]
            cls = getattr(pipelining, SCHEDULES[self.schedule][0])
            kwargs: dict[str, Any] = {"n_microbatches": micro_batches, "loss_fn": self._loss}
            self._built[key] = cls(stages if is_multi_stage(self.schedule) else stages[0], **kwargs)
        return self._built[key]

    def run(self, step: ForwardBackward, convert_input: Callable[[Any], Any], forward_context: Callable[[], Any]) -> Tensor:
        """One schedule step over ``step``'s batch (every rank passes the same batch; the first stage reads the inputs,
        the last the target). Returns the mean micro-batch loss on every pipeline rank."""
        if step.target is None:
            raise TypeError(
                "A pipeline-parallel `fabric.forward_backward` needs `target=`: the last stage computes"
                " `loss_fn(output, target)` for each micro-batch."
            )
        micro_batches = step.micro_batches or self.micro_batches
        check_micro_batches(self.schedule, micro_batches, self.pipeline_size)
        args, kwargs = convert_input((tuple(step.args), dict(step.kwargs)))
        parts = step.split((args, kwargs, step.target), micro_batches)  # checks the batch divides evenly
        if self.check is not None:
            first_args, first_kwargs, _ = parts[0]
            self.check.verify(first_args, first_kwargs)
            self.check = None
        schedule = self._schedule_for((micro_batches, _signature((args, kwargs, step.target))), micro_batches)
        losses: list[Tensor] = []
        self._step = step
        try:
            with forward_context():
                schedule.step(
                    *(args if self.holds_first else ()),
                    target=step.target if self.holds_last else None,
                    losses=losses if self.holds_last else None,
                    return_outputs=False,
                    **(kwargs if self.holds_first else {}),
                )
        finally:
            self._step = None
        value = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros((), device=self.device)
        last = dist.get_global_rank(self.group, (self.num_stages - 1) % self.pipeline_size)
        dist.broadcast(value, src=last, group=self.group)
        return value


    def complete_param_groups(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict (DCP's, keyed by name) whose ``param_groups`` list every stage's parameters, in the
        whole model's order: each rank's lists only its own, and a checkpoint keeps one rank's copy. Collective over
        the pipeline ranks."""
        from fabric_core.utilities import all_gather_object

        groups = state.get("param_groups", [])
        everyone = all_gather_object([list(g["params"]) for g in groups], group=self.group)
        order = {name: i for i, name in enumerate(self.full_names)}
        merged = []
        for index, group in enumerate(groups):
            names = {n for lists in everyone if index < len(lists) for n in lists[index]}
            merged.append({**group, "params": sorted(names, key=lambda n: order.get(n, len(order)))})
        return {**state, "param_groups": merged}


# ----------------------------------------------------------------------------------------------------- the whole setup
#: Models split into pipeline stages, each with its :class:`Pipeline` (weak: forgetting the model frees both).
_PIPELINES: weakref.WeakKeyDictionary[Module, Pipeline] = weakref.WeakKeyDictionary()


def pipeline_of(model: Module) -> Pipeline | None:
    """The pipeline a set-up model runs through, or ``None`` for a model that is not split into stages."""
    return _PIPELINES.get(model)


def split_model(
    model: Module,
    split: Split,
    *,
    pipeline_rank: int,
    pipeline_size: int,
    stages_per_rank: int,
) -> tuple[list[Module], list[int], ChainCheck | None, list[str]]:
    """Cut ``model`` into ``pipeline_size * stages_per_rank`` stages, check them, and keep only this rank's parts in
    ``model`` (in place). Returns this rank's stage modules, their indices, the chain check of a split by names, and
    the whole model's parameter names in order."""
    full_names = [n for n, _ in model.named_parameters()]
    num_stages = pipeline_size * stages_per_rank
    check_split(split, num_stages, pipeline_size, stages_per_rank)
    check: ChainCheck | None = None
    if callable(split) and not isinstance(split, str):
        stages = stages_by_function(model, split, num_stages)
    else:
        stages, names = stages_by_names(model, list(split))
        check = ChainCheck(clone_on_meta(model), names)
    check_stages(model, stages)
    indices = stage_indices(pipeline_rank, pipeline_size, stages_per_rank)
    keep = {id(p) for i in indices for p in stages[i].parameters()}
    stage_of = {id(p): i for i, stage in enumerate(stages) for p in stage.parameters()}
    prune(model, keep, stage_of)
    return [stages[i] for i in indices], indices, check, full_names


def register(model: Module, pipeline: Pipeline) -> None:
    """Remember ``model``'s pipeline and refuse ``model(x)`` on it."""
    _PIPELINES[model] = pipeline
    refuse_forward(model)
