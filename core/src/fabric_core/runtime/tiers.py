"""Checkpoint tiers: snapshots in memory every step, copied to a peer node, beside disk and remote checkpoints each at
their own interval; recovery from the fastest complete one.

::

    tiers = fabric.checkpoint_tiers(memory_every=1, disk_every=50)   # disk: <run folder>/checkpoints/step-*.ckpt
    state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": RandomStates(fabric), "step": 0}
    latest = fabric.latest_checkpoint(tiers)     # "mem://step-000000123", a disk checkpoint, or None
    if latest is not None:
        fabric.load(latest, state)               # falls back to the previous complete checkpoint of any tier
    while state["step"] < max_steps:
        ...                                      # forward, backward, optimizer.step()
        state["step"] += 1
        tiers.save(state["step"], state)         # the tiers due at this step (and the preemption check)
    tiers.close()                                # training finished: the memory snapshots are released

* **Memory tier** (:mod:`fabric_core.io.memory`, :mod:`fabric_core.io.snapshot_store`): every ``memory_every`` steps
  each rank writes its state into the node's shared memory (keyed by its topology coordinates), overlapping the copy
  with the next forward and backward; the node's keeper (:mod:`fabric_core.io.keeper`) copies it to the keeper of the
  next node (rank r to the same local rank of node n+1), so a node lost whole loses no snapshot.
* **Disk and remote tiers**: ``fabric.save`` checkpoints every ``disk_every``/``remote_every`` steps, pruned to
  ``*_keep_last``. For the single-file format (every strategy that does not shard) they are written from the memory
  snapshot of that step *by the keeper*, a process of its own: serialising and writing never take the training
  process's GIL. Other formats save through their own asynchronous path.
* **Recovery** (:meth:`latest`, :meth:`load`): every rank reports what its node holds; the newest step that every
  rank can restore wins, memory before disk at the same step. A rank whose node lost its memory fetches its snapshot
  from the node holding its peer copy. A snapshot is checked against its checksum before anything is restored; if
  it fails on any rank, every rank falls back to the previous complete checkpoint of any tier and says so.
* **Preemption** (:mod:`fabric_core.runtime.preemption`): SIGTERM or SIGUSR1 makes every rank save at the next step
  (memory, its peer copy, then disk if the grace period allows) and exit with status 75 for a requeue.
* **Non-finite losses** (opt-in, :meth:`rollback_if_not_finite`): restore the last memory snapshot, skip the batch.
* **Limits**: a rank's snapshots take ``(memory_keep_last + 1)`` times its state in shared memory, and as much again
  for the peer copies its node keeps for another node. This is checked before the first snapshot; if the node has
  less room, the memory tier is off with an error naming the sizes and the setting, and the other tiers go on.

Tier files that belong on disk go under the run folder (:mod:`fabric_core.runtime.run`): ``checkpoints/`` (disk
checkpoints by default, ``recovery/attempt-<A>.json`` records what each attempt resumed from) and ``compile-cache/``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import socket
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric_core.io import background, keeper, memory, retention
from fabric_core.io import snapshot_store as store
from fabric_core.io.location import CheckpointLocation
from fabric_core.io.series import CheckpointSeries
from fabric_core.io.state import is_stateful
from fabric_core.runtime import compile_cache as _compile_cache
from fabric_core.runtime import preemption as _preemption

if TYPE_CHECKING:
    from fabric_core.io.background import CheckpointHandle

__all__ = ["MEMORY_SCHEME", "CheckpointTiers", "TierSave", "is_memory_location"]

MEMORY_SCHEME = "mem://"
MEMORY, DISK, REMOTE = "memory", "disk", "remote"
_TIER_ORDER = {MEMORY: 0, DISK: 1, REMOTE: 2}
KEEPER_ADDRESS_VARIABLE = "FABRIC_KEEPER_ADDRESS"
#: How long a disk or remote write by the keeper may take before the save counts as failed.
_WRITE_TIMEOUT_S = 3600.0


def is_memory_location(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(MEMORY_SCHEME)


def memory_location(step: int) -> str:
    return MEMORY_SCHEME + store.snapshot_name(step)


# ------------------------------------------------------------------------------------------------------ topology
def _axes(topology: Any) -> list[Any]:
    return [axis for axis in getattr(topology, "axes", ()) if not axis.fault_tolerant]


def rank_key(topology: Any) -> str:
    """A rank's snapshots are filed under its coordinates on every (non fault-tolerant) axis: ``data_replicate-2``,
    ``replicate-0.shard-1``; one process without axes: ``single``."""
    return ".".join(f"{axis.name}-{axis.coordinate}" for axis in _axes(topology)) or "single"


def layout_of(topology: Any) -> dict[str, Any]:
    """What a set of snapshots must match to be restored rank by rank: the world size and every axis's size."""
    return {"world_size": topology.world_size, "axes": [[axis.name, axis.size] for axis in _axes(topology)]}


def all_keys(layout: Mapping[str, Any]) -> list[str]:
    """Every rank key of a layout, the all-zero coordinates first."""
    axes = layout["axes"]
    if not axes:
        return ["single"]
    return [".".join(f"{name}-{c}" for (name, _), c in zip(axes, coords)) for coords in itertools.product(*(range(size) for _, size in axes))]


def _advertised_address() -> str:
    """The address other nodes reach this node's keeper at: ``FABRIC_KEEPER_ADDRESS``, else the address of the
    interface that routes to the rendezvous host (no packet is sent), else the host name's."""
    chosen = os.environ.get(KEEPER_ADDRESS_VARIABLE, "").strip()
    if chosen:
        return chosen
    target = os.environ.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _owner_pid() -> int:
    """The process whose lifetime the node's keeper follows: the launcher's (``fabric run``/torchrun's agent, the
    subprocess launcher's rank 0, Ray's worker host), i.e. this process's parent where a launcher started it."""
    if os.environ.get("FABRIC_KEEPER_OWNER", "").strip().isdigit():
        return int(os.environ["FABRIC_KEEPER_OWNER"])
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return os.getppid()
    return os.getpid()


# ------------------------------------------------------------------------------------------------------ handles
@dataclass
class TierSave:
    """What :meth:`CheckpointTiers.save` started at one step: ``handles`` by tier (disk/remote), and whether a memory
    snapshot was taken. ``wait()`` waits for all of it (the memory snapshot committed, the files written)."""

    step: int
    tiers: list[str] = field(default_factory=list)
    handles: dict[str, CheckpointHandle] = field(default_factory=dict)
    _owner: Any = None

    def wait(self) -> None:
        if self._owner is not None and MEMORY in self.tiers:
            self._owner._finish_snapshot()
        for handle in self.handles.values():
            handle.wait()


@dataclass
class _Candidate:
    tier: str
    step: int
    location: str
    #: memory: which rank key each rank of this attempt restores, and where each key can be found
    layout: dict[str, Any] | None = None
    same_layout: bool = False
    holders: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # key -> [(node, kind)]

    def describe(self) -> str:
        if self.tier == MEMORY:
            return f"the memory snapshot of step {self.step}"
        return f"the {self.tier} checkpoint {self.location}"


# ------------------------------------------------------------------------------------------------------ the tiers
class CheckpointTiers:
    """Checkpoints in memory, on disk and at a URL, each with its own interval; create with
    ``fabric.checkpoint_tiers(...)`` on every rank (it is a collective). See the module for the whole picture.

    Args:
        memory_every: snapshot into shared memory every this many steps (``None``: no memory tier).
        memory_keep_last: memory snapshots kept per rank (and per peer copy).
        peer_copies: copy each rank's snapshot to the next node's keeper (needs more than one node).
        memory_limit: bytes of shared memory the tier may use on a node (default: what the folder's filesystem, the
            RAM and the cgroup leave).
        disk: the disk series, ``*`` for the step (``"ckpts/step-*.ckpt"``); ``True``: ``<run folder>/checkpoints/
            step-*.ckpt``; ``None``: no disk tier.
        disk_every, disk_keep_last: its interval and retention.
        remote, remote_every, remote_keep_last: the same for a URL series (``"s3://bucket/run/step-*.ckpt"``).
        overlap: copy parameters and optimizer states while the next forward/backward run (see
            :mod:`fabric_core.io.memory`); ``False`` copies everything in :meth:`save`.
        preemption: save and exit with the requeue status on SIGTERM/SIGUSR1 (:mod:`fabric_core.runtime.preemption`).
        grace_period: seconds the scheduler gives after its signal (default ``FABRIC_PREEMPTION_GRACE``, else 30).
        compile_cache: keep torch.compile's cache artifacts in the run folder and load them at the start of every
            attempt (:mod:`fabric_core.runtime.compile_cache`).
    """

    def __init__(
        self,
        fabric: Any,
        *,
        unwrap: Callable[[Any], Any] = lambda state: state,
        memory_every: int | None = 1,
        memory_keep_last: int = 2,
        peer_copies: bool = True,
        memory_limit: int | None = None,
        disk: str | os.PathLike | bool | None = True,
        disk_every: int = 50,
        disk_keep_last: int | None = 3,
        remote: str | None = None,
        remote_every: int = 500,
        remote_keep_last: int | None = None,
        overlap: bool = True,
        preemption: bool = True,
        grace_period: float | None = None,
        compile_cache: bool = False,
    ) -> None:
        for name, value in (("memory_every", memory_every), ("disk_every", disk_every), ("remote_every", remote_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`{name}` must be a positive number of steps, got {value!r}.")
        for name, value in (("memory_keep_last", memory_keep_last), ("disk_keep_last", disk_keep_last), ("remote_keep_last", remote_keep_last)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        self._fabric = fabric
        self._unwrap = unwrap
        self.strategy = fabric.strategy
        self.run_info = fabric.run_info
        if disk is True:
            disk = self.run_info.dir / "checkpoints" / "step-*.ckpt"
        self.overlap = overlap
        self.memory_every = memory_every
        self.memory_keep_last = memory_keep_last
        self.peer_copies = peer_copies
        self.memory_limit = memory_limit
        self.disk = self._series(disk, "disk") if disk is not None and disk is not False else None
        self.disk_every, self.disk_keep_last = disk_every, disk_keep_last
        self.remote = self._series(remote, "remote") if remote else None
        self.remote_every, self.remote_keep_last = remote_every, remote_keep_last
        if self.remote is not None and not CheckpointLocation.of(self.remote).is_url:
            raise ValueError(f"`remote` is for a URL series (s3://, gs://, ...), got {remote!r}; a local folder is `disk`.")
        #: why the memory tier is off (too little shared memory, ...), or ``None`` while it works
        self.memory_error: Exception | None = None
        #: what the last :meth:`load` restored: tier, step, where from, fallbacks taken, seconds
        self.recovery: dict[str, Any] | None = None
        self.stats: dict[str, Any] = {}
        self._candidates: list[_Candidate] = []
        self._rolled_back_to: set[int] = set()
        self._hooked: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._writer: memory.SnapshotWriter | None = None
        self._checked_space = False
        self._closed = False
        self._compile_stored = False
        self._keeper: keeper.KeeperClient | None = None
        self.keeper_pid: int | None = None
        self._nodes: dict[int, dict[str, Any]] = {}
        self._peer: dict[str, Any] | None = None

        self.run_info.path("checkpoints", "recovery", "")  # records the run in run.json: a restart finds the same run id
        topology = self.strategy.topology
        self.key = rank_key(topology)
        self.layout = layout_of(topology)
        self.root = store.default_root(self.run_info.id)
        self._setup_keeper(topology)
        self.preemption = _preemption.PreemptionNotice(grace_period=grace_period).install() if preemption else None
        self.compile_cache = compile_cache
        if compile_cache:
            self.stats["compile_cache_restored"] = _compile_cache.restore(self.run_info.dir / _compile_cache.FOLDER, self.strategy.global_rank)
        atexit.register(_finish_at_exit, weakref.ref(self))

    @staticmethod
    def _series(value: Any, tier: str) -> str:
        text = str(value)
        if "*" not in CheckpointLocation.of(text).name:
            raise ValueError(
                f"`{tier}` names the {tier} checkpoints' series with `*` where the step goes, e.g. 'ckpts/step-*.ckpt';"
                f" got {text!r}."
            )
        return text

    # ------------------------------------------------------------------------------------------ set-up
    @property
    def memory_on(self) -> bool:
        return self.memory_every is not None and self.memory_error is None

    def _needs_memory(self) -> bool:
        return self.memory_every is not None or self._writes_from_memory(DISK) or self._writes_from_memory(REMOTE)

    def _setup_keeper(self, topology: Any) -> None:
        """Start (or find) this node's keeper and learn every node's: a collective, on every rank."""
        mine: dict[str, Any] = {"node": topology.node_rank, "local_rank": topology.local_rank, "key": self.key}
        error = None
        if self.memory_every is not None or self.disk is not None or self.remote is not None:
            try:
                self._keeper, self.keeper_pid = keeper.ensure_keeper(self.root, _owner_pid())
                self._keeper.request("register", owner=_owner_pid(), key=self.key, ranks=topology.processes_per_node)
                mine.update(address=_advertised_address(), port=self._keeper.address[1], token=self._keeper.token)
            except (OSError, keeper.KeeperError) as err:
                error = memory.MemoryTierError(f"The memory tier's keeper could not start on this node: {err}")
        everyone = self.strategy.all_gather_object({**mine, "error": str(error) if error else None})
        failed = [entry for entry in everyone if entry.get("error")]
        if failed:
            self._memory_off(memory.MemoryTierError(f"node {failed[0]['node']}: {failed[0]['error']}"))
        for entry in everyone:
            if "port" in entry:
                self._nodes.setdefault(entry["node"], {k: entry[k] for k in ("address", "port", "token")})
        nodes = sorted(self._nodes)
        if self.peer_copies and len(nodes) > 1 and self.memory_error is None:
            following = nodes[(nodes.index(topology.node_rank) + 1) % len(nodes)]
            self._peer = self._nodes[following]

    def _memory_off(self, error: Exception) -> None:
        if self.memory_error is None:
            self.memory_error = error
            message = f"{error} Training continues with the other checkpoint tiers."
            if self.disk is None and self.remote is None:
                raise memory.MemoryTierError(f"{error} No other checkpoint tier is configured.") from None
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _check_space(self, converted: Any) -> None:
        """Before the first snapshot: will the node's shared memory hold (keep_last + 1) snapshots of every local rank,
        and as many peer copies? Every rank agrees; if any node cannot, the memory tier is off everywhere."""
        per_snapshot = memory.state_bytes(converted)
        copies = self.memory_keep_last + 1 if self.memory_every is not None else 1
        per_rank = per_snapshot * copies * (2 if self._peer is not None else 1)
        sizes = self.strategy.all_gather_object((self.strategy.topology.node_rank, per_rank, per_snapshot))
        node = self.strategy.topology.node_rank
        need = sum(size for n, size, _ in sizes if n == node)
        ranks_here = sum(1 for n, _, _ in sizes if n == node)
        problem = None
        if self.strategy.topology.local_rank == 0:  # one judge per node: the folder and the RAM are the node's
            problem = self._space_problem(node, need, ranks_here, copies, per_snapshot)
        problems = [p for p in self.strategy.all_gather_object(problem) if p]
        self.stats["snapshot_bytes"] = per_snapshot
        self.stats["memory_needed_per_rank"] = per_rank
        if problems:
            self._memory_off(memory.MemoryTierError(problems[0]))
        self._checked_space = True

    def _space_problem(self, node: int, need: int, ranks_here: int, copies: int, per_snapshot: int) -> str | None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            held = store.bytes_held(self.root)
            limits = {f"{self.root} ({_filesystem(self.root)})": store.free_bytes(self.root) + held}
            ram = _available_ram()
            if ram is not None:
                limits["the RAM available"] = ram + held
            cgroup = _cgroup_room()
            if cgroup is not None:
                limits["the cgroup's memory limit"] = cgroup + held
            if self.memory_limit is not None:
                limits["memory_limit"] = self.memory_limit
        except OSError as err:
            return f"The memory tier cannot use {self.root}: {err}. Set {store.MEMORY_DIR_VARIABLE} to a writable tmpfs folder."
        where, available = min(limits.items(), key=lambda item: item[1])
        if need <= available:
            return None
        return (
            f"The memory tier needs {_size(need)} of shared memory on node {node} ({ranks_here} rank(s) x {copies}"
            f" snapshot(s) of {_size(per_snapshot)}"
            + (", and as much again for the peer copies of another node's ranks" if self._peer else "")
            + f"), but {where} leaves {_size(available)}. Give it more room (docker run --shm-size=...; Kubernetes:"
            f" an emptyDir with medium: Memory and a sizeLimit), point {store.MEMORY_DIR_VARIABLE} at a larger"
            " tmpfs, or lower memory_keep_last."
        )

    # ------------------------------------------------------------------------------------------ saving
    def save(self, step: int, state: Mapping[str, Any]) -> TierSave:
        """Save ``state`` to every tier due at ``step`` (call after each optimizer step, on every rank). A preemption
        notice received on any rank is answered here: save, then exit with the requeue status."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"`tiers.save(step, state)` needs the step as a non-negative int, got {step!r}.")
        if self._closed:
            raise RuntimeError("These checkpoint tiers were closed; create new ones with `fabric.checkpoint_tiers(...)`.")
        if self.preemption is not None and self._preemption_requested():
            self._save_for_preemption(step, state)
        result = TierSave(step, _owner=self)
        disk_due = self.disk is not None and step % self.disk_every == 0
        remote_due = self.remote is not None and step % self.remote_every == 0
        memory_due = self.memory_every is not None and step % self.memory_every == 0
        from_memory = (disk_due and self._writes_from_memory(DISK)) or (remote_due and self._writes_from_memory(REMOTE))
        if (memory_due or from_memory) and self.memory_error is None:
            unwrapped = self._unwrap(state)
            self._snapshot(step, unwrapped, overlap=self.overlap)
            if self.memory_error is None:
                result.tiers.append(MEMORY)
        for tier, due, series, keep in ((DISK, disk_due, self.disk, self.disk_keep_last), (REMOTE, remote_due, self.remote, self.remote_keep_last)):
            if due and series is not None:
                result.handles[tier] = self._save_file_tier(tier, step, state, series, keep)
                result.tiers.append(tier)
        if self.compile_cache and not self._compile_stored and (disk_due or remote_due):
            self._store_compile_cache()
        return result

    def _writes_from_memory(self, tier: str) -> bool:
        """Whether ``tier``'s files are written by the keeper from the memory snapshot (the single-file format
        through our own ``CheckpointIO``), rather than by the strategy's format in this process."""
        from fabric_core.io.checkpoint_io import TorchCheckpointIO
        from fabric_core.io.single_file import SingleFileFormat

        if self._keeper is None or self.memory_error is not None:
            return False
        checkpoint_format = self.strategy.checkpoint_format()
        return isinstance(checkpoint_format, SingleFileFormat) and type(checkpoint_format.checkpoint_io) is TorchCheckpointIO

    def _snapshot(self, step: int, state: Mapping[str, Any], overlap: bool) -> None:
        context = self.strategy.checkpoint_context()
        began = time.perf_counter()
        converted = context.state_to_save(state)
        if not self._checked_space:
            self._check_space(converted)
            if self.memory_error is not None:
                return
        deferred: set[int] = set()
        names: dict[int, str] = {}
        if overlap:
            deferred, names = self._deferrable(state)
        topology = self.strategy.topology
        manifest = {
            "key": self.key,
            "layout": self.layout,
            "keys": all_keys(self.layout),
            "global_rank": topology.global_rank,
            "node_rank": topology.node_rank,
            "local_rank": topology.local_rank,
            "run_id": self.run_info.id,
            "attempt": self.run_info.attempt,
            "complete": _complete(state, converted),
        }
        writer = self._snapshot_writer()
        try:
            writer.begin(step, converted, manifest, deferred, names)
        except memory.MemoryTierError as err:
            self._memory_off(err)
            return
        del converted
        self.stats["last_snapshot_call_s"] = time.perf_counter() - began
        self.stats["last_snapshot_step"] = step

    def _snapshot_writer(self) -> memory.SnapshotWriter:
        if self._writer is None:
            keep = self.memory_keep_last if self.memory_every is not None else 1
            self._writer = memory.SnapshotWriter(store.rank_folder(self.root, store.OWN, self.key), keep, self._committed)
        return self._writer

    def _committed(self, step: int, path: Path) -> None:
        """In the writer's thread, after a commit: have the keeper copy it to the peer node."""
        if self._peer is None or self._keeper is None or self.memory_every is None:
            return
        self._keeper.request(
            "replicate", path=str(path), key=self.key, step=step, host=self._peer["address"], port=self._peer["port"],
            peer_token=self._peer["token"], keep_last=self.memory_keep_last,
        )  # fmt: skip

    def _deferrable(self, state: Mapping[str, Any]) -> tuple[set[int], dict[int, str]]:
        """The storages only an optimizer step changes (its parameters and states), with each optimizer's step
        pre-hook installed so the step waits for their copy."""
        storages: set[int] = set()
        names: dict[int, str] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                for name, parameter in obj.named_parameters():
                    names[parameter.untyped_storage().data_ptr()] = f"parameter {name!r} of {key!r}"
        for obj in state.values():
            if not isinstance(obj, Optimizer):
                continue
            if obj not in self._hooked:
                obj.register_step_pre_hook(_gate_hook(weakref.ref(self)))
                self._hooked.add(obj)
            for group in obj.param_groups:
                for parameter in group["params"]:
                    storages.add(parameter.untyped_storage().data_ptr())
            for per_parameter in obj.state.values():
                for value in per_parameter.values():
                    if isinstance(value, Tensor) and value.numel():
                        storages.add(value.untyped_storage().data_ptr())
        return storages, names

    def _gate(self) -> None:
        if self._writer is not None:
            self._writer.gate()

    def _finish_snapshot(self) -> None:
        if self._writer is not None:
            self._writer.finish_previous()

    def _save_file_tier(self, tier: str, step: int, state: Mapping[str, Any], series: str, keep_last: int | None) -> CheckpointHandle:
        path = series.replace("*", f"{step:09d}", 1)
        location = CheckpointLocation.of(path)
        pending = self._writer.pending if self._writer is not None else None
        if self._writes_from_memory(tier) and pending is not None and pending.step == step:
            if not self.strategy.is_global_zero:
                return background.completed(location)
            client = self._keeper
            assert client is not None
            pending.hold = True  # set before the commit can happen: the gate has not run yet
            target = str(location) if location.is_url else str(location.path.absolute())

            def write() -> None:
                try:
                    pending.done.wait()
                    if pending.error is not None or not pending.valid:
                        raise RuntimeError(
                            f"The memory snapshot of step {step} that the {tier} checkpoint is written from was not"
                            f" committed ({pending.error or 'dropped'}); the {tier} tier skips step {step}."
                        )
                    started = time.perf_counter()
                    client.request("write", snapshot=str(pending.target), target=target, wait=_WRITE_TIMEOUT_S)
                    self.stats[f"last_{tier}_write_s"] = time.perf_counter() - started
                finally:
                    pending.release()
                    if self._writer is not None:  # what was kept for this write may go now
                        store.prune(self._writer.folder, self._writer.keep_last)

            handle = background.submit(location, write)
            handle.before_wait = self._finish_snapshot  # the file waits for the snapshot's copies overlapping the next step
            if keep_last is not None:
                background.submit(location, partial(retention.prune, location, keep_last))
            return handle
        handle = self._fabric.save(path, dict(state), async_save=True, keep_last=keep_last)
        return handle

    def _store_compile_cache(self) -> None:
        try:
            self.stats["compile_cache_bytes"] = _compile_cache.store(self.run_info.dir / _compile_cache.FOLDER, self.strategy.global_rank)
            self._compile_stored = self.stats["compile_cache_bytes"] > 0
        except Exception as err:  # a cache is an optimisation: never fail a save for it
            warnings.warn(f"Keeping torch.compile's cache artifacts failed: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
            self._compile_stored = True

    def wait(self) -> None:
        """Wait for everything this rank started: the snapshot in progress committed, files written."""
        self._finish_snapshot()
        background.wait_all()

    def wait_replicated(self, step: int, timeout: float = 60.0) -> bool:
        """Wait until this rank's snapshot of ``step`` (or a newer one) reached the peer node; whether it did."""
        self._finish_snapshot()
        if self._peer is None or self._keeper is None:
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self._keeper.request("status")
            if status["replicated"].get(self.key, -1) >= step:
                return True
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------------------------------ preemption
    def _preemption_requested(self) -> bool:
        assert self.preemption is not None
        return self.strategy.reduce_boolean_decision(self.preemption.requested, all=False)

    def _save_for_preemption(self, step: int, state: Mapping[str, Any]) -> None:
        """Every rank is here at the same step: memory snapshot (synchronous) and its peer copy, then disk if the
        grace period leaves time for it, then exit with the requeue status."""
        assert self.preemption is not None
        started = time.monotonic()
        saved = []
        if self.memory_error is None and self._keeper is not None:
            self._finish_snapshot()
            self._snapshot(step, self._unwrap(state), overlap=False)
            self._finish_snapshot()
            if self.memory_error is None:
                saved.append(memory_location(step))
                if self._peer is not None:
                    self.wait_replicated(step, timeout=max(1.0, self.preemption.time_left() / 2))
        estimate = self.stats.get("last_disk_write_s", 0.0) * 2 + 1.0
        if self.disk is not None and (not saved or self.preemption.time_left() > estimate):
            path = self.disk.replace("*", f"{step:09d}", 1)
            self._fabric.save(path, dict(state), keep_last=self.disk_keep_last)
            saved.append(path)
        if self.compile_cache:
            self._store_compile_cache()
        self._record("preempted", {"step": step, "saved": saved, "seconds": time.monotonic() - started})
        received = self.preemption.received.name if self.preemption.received else "a preemption notice"
        self.strategy.barrier()
        with contextlib.suppress(Exception):
            from fabric_core.runtime.process_group import release_process_group

            release_process_group()
        self.preemption.exit(f"{received}: saved step {step} to {', '.join(saved) or 'nothing'}")

    # ------------------------------------------------------------------------------------------ finding
    def latest(self) -> str | None:
        """The newest checkpoint every rank can restore, across tiers (memory first at the same step); the same on
        every rank (a collective). ``None`` when there is none."""
        self._finish_snapshot()
        self._candidates = self._collect()
        return self._candidates[0].location if self._candidates else None

    def _collect(self) -> list[_Candidate]:
        topology = self.strategy.topology
        local: list[tuple[str, str, int, dict[str, Any], bool]] = []
        if topology.local_rank == 0 and self.root.is_dir():
            for snapshot in store.inventory(self.root):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    manifest = store.read_manifest(snapshot.path)
                    if manifest.get("run_id") == self.run_info.id:
                        local.append((snapshot.kind, snapshot.key, snapshot.step, manifest["layout"], bool(manifest.get("complete", True))))
        files: list[tuple[str, int, str]] = []
        if self.strategy.is_global_zero:
            for tier, series in ((DISK, self.disk), (REMOTE, self.remote)):
                if series is None:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    found = CheckpointSeries.of(series)
                    for entry in found.committed_members():
                        number = found.number(entry.name)
                        if number:
                            files.append((tier, number[0], str(entry)))
        gathered = self.strategy.all_gather_object({"node": topology.node_rank, "memory": local, "files": files})
        candidates: list[_Candidate] = []
        groups: dict[tuple[int, str], _Candidate] = {}
        complete_keys: dict[tuple[int, str], set[str]] = {}
        for entry in gathered:
            for kind, key, step, layout, complete in entry["memory"]:
                signature = json.dumps(layout, sort_keys=True)
                candidate = groups.setdefault((step, signature), _Candidate(MEMORY, step, memory_location(step), layout))
                candidate.holders.setdefault(key, []).append((entry["node"], kind))
                if complete:
                    complete_keys.setdefault((step, signature), set()).add(key)
            for tier, step, location in entry["files"]:
                candidates.append(_Candidate(tier, step, location))
        current = json.dumps(self.layout, sort_keys=True)
        for (step, signature), candidate in groups.items():
            keys = all_keys(candidate.layout)
            if signature == current and set(keys) <= set(candidate.holders):
                candidate.same_layout = True
                candidates.append(candidate)
            elif keys[0] in complete_keys.get((step, signature), set()):
                candidates.append(candidate)  # restored from the all-zero coordinates' snapshot, a full state
        candidates.sort(key=lambda c: (-c.step, _TIER_ORDER[c.tier], not c.same_layout))
        return candidates

    # ------------------------------------------------------------------------------------------ loading
    def owns(self, path: Any) -> bool:
        text = str(path)
        return is_memory_location(text) or any(c.location == text for c in self._candidates)

    def load(self, checkpoint: Any, state: Any, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore ``state`` (unwrapped objects) from ``checkpoint`` (what :meth:`latest` returned) on every rank;
        if it cannot be used on some rank, fall back to the next older complete checkpoint of any tier, with a
        warning naming the rank and the reason. Returns what the checkpoint holds beyond ``state``."""
        started = time.perf_counter()
        self._finish_snapshot()
        text = str(checkpoint)
        if not any(c.location == text for c in self._candidates):
            self._candidates = self._collect()
        index = next((i for i, c in enumerate(self._candidates) if c.location == text), None)
        if index is None:
            raise FileNotFoundError(
                f"{text!r} is not a checkpoint any tier holds now (it may have been pruned). Ask"
                " `fabric.latest_checkpoint(tiers)` for the newest one."
            )
        fallbacks: list[str] = []
        for candidate in self._candidates[index:]:
            loaded, source, error = self._prepare(candidate, weights_only)
            if self.strategy.reduce_boolean_decision(error is None, all=True):
                remainder = self._restore(candidate, loaded, state, strict, weights_only)
                del loaded
                memory.release_unused()
                self.recovery = {
                    "tier": candidate.tier, "step": candidate.step, "location": candidate.location, "source": source,
                    "fallbacks": fallbacks, "seconds": time.perf_counter() - started,
                }  # fmt: skip
                self._record("resumed", self.recovery)
                return remainder
            reasons = self.strategy.all_gather_object(error)
            why = "; ".join(f"rank {rank}: {reason}" for rank, reason in enumerate(reasons) if reason)
            following = self._candidates[self._candidates.index(candidate) + 1 :]
            then = following[0].describe() if following else "nothing (no older checkpoint in any tier)"
            fallbacks.append(f"{candidate.describe()}: {why}")
            warnings.warn(f"Could not restore {candidate.describe()} ({why}); falling back to {then}.", RuntimeWarning, stacklevel=3)
        raise RuntimeError("No checkpoint of any tier could be restored: " + " | ".join(fallbacks))

    def _needed_key(self, candidate: _Candidate) -> str:
        return self.key if candidate.same_layout else all_keys(candidate.layout)[0]

    def _prepare(self, candidate: _Candidate, weights_only: bool | None) -> tuple[Any, str | None, str | None]:
        """This rank's part of a candidate, read and checked, or the reason it cannot be used."""
        if candidate.tier != MEMORY:
            return None, candidate.location, None  # a file is checked by its format while it loads
        key = self._needed_key(candidate)
        try:
            loaded, manifest, source = self._read(candidate, key, weights_only is not False)
            if manifest.get("key") != key or manifest.get("step") != candidate.step or manifest.get("layout") != candidate.layout:
                raise store.SnapshotChecksumError(f"{source} holds {manifest.get('key')} at step {manifest.get('step')} of another layout")
            return loaded, source, None
        except Exception as err:  # every reason counts: the ranks vote, then all fall back together
            return None, None, f"{type(err).__name__}: {err}"

    def _read(self, candidate: _Candidate, key: str, weights_only: bool) -> tuple[Any, dict[str, Any], str]:
        """``(state, manifest, source)`` of ``key``'s snapshot, checked, in this process's memory: read from this
        node's memory (own or a peer copy), else fetched from the node holding it straight into this process (not
        written to this node's memory too: its next snapshot is, a step later)."""
        name = store.snapshot_name(candidate.step)
        node = self.strategy.topology.node_rank
        for kind in (store.OWN, store.PEER):
            folder = store.rank_folder(self.root, kind, key) / name
            if folder.is_dir():
                loaded, manifest = memory.read_snapshot(folder, weights_only=weights_only, copy=True)
                return loaded, manifest, f"{kind} memory of node {node}"
        holders = candidate.holders.get(key, [])
        for holder, kind in sorted(holders, key=lambda h: (h[1] != store.PEER, h[0])):
            info = self._nodes.get(holder)
            if info is None or holder == node:
                continue
            client = keeper.KeeperClient(info["address"], info["port"], info["token"], timeout=120)
            manifest, skeleton, data = client.fetch(key, candidate.step, memory.private_buffer)
            source = f"{kind} memory of node {holder}, fetched"
            return memory.state_from_parts(manifest, skeleton, data, weights_only, where=source), manifest, source
        raise FileNotFoundError(f"no node holds the snapshot of {key} at step {candidate.step} any more")

    def _restore(self, candidate: _Candidate, loaded: Any, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        if candidate.tier != MEMORY:
            return self.strategy.load_checkpoint(path=CheckpointLocation.of(candidate.location), state=state, strict=strict, weights_only=weights_only)
        return self.strategy.checkpoint_context().restore(state, loaded, strict)

    # ------------------------------------------------------------------------------------------ bad steps
    def rollback_if_not_finite(self, loss: Tensor, state: Mapping[str, Any]) -> bool:
        """If ``loss`` is not finite on any rank, restore every rank's newest memory snapshot not yet rolled back to
        (all of ``state`` but its dataloaders, which stay past the bad batch) and return ``True``: skip this batch.
        Repeated non-finite losses walk back through the kept snapshots. Call it on every rank, before backward."""
        bad = not bool(torch.isfinite(loss.detach()).all())
        if not self.strategy.reduce_boolean_decision(bad, all=False):
            self._rolled_back_to.clear()
            return False
        if self.memory_error is not None or self._writer is None:
            raise RuntimeError("The loss is not finite and there is no memory snapshot to roll back to (the memory tier is off).")
        self._finish_snapshot()
        folder = store.rank_folder(self.root, store.OWN, self.key)
        usable = [step for step, _ in store.committed(folder) if step not in self._rolled_back_to]
        step = usable[-1] if usable else None
        steps = self.strategy.all_gather_object(step)
        if any(s is None for s in steps) or len(set(steps)) != 1:
            raise RuntimeError(f"The loss is not finite and the ranks have no common memory snapshot left to roll back to (newest per rank: {steps}).")
        unwrapped = self._unwrap(state)
        kept = {key: value for key, value in unwrapped.items() if _is_dataloader(value)}
        restore_into = {key: value for key, value in unwrapped.items() if key not in kept}
        loaded, _ = memory.read_snapshot(folder / store.snapshot_name(step), copy=True)
        loaded = {key: value for key, value in loaded.items() if key not in kept}
        self.strategy.checkpoint_context().restore(restore_into, loaded, strict=False)
        if isinstance(state, dict):
            for key, value in restore_into.items():
                if key in state and not isinstance(state[key], (Module, Optimizer)) and not is_stateful(state[key]):
                    state[key] = value
        del loaded
        memory.release_unused()
        self._rolled_back_to.add(step)
        self.stats.setdefault("rollbacks", []).append(step)
        warnings.warn(f"The loss is not finite: rolled back to the memory snapshot of step {step} and skipped the batch.", RuntimeWarning, stacklevel=2)
        return True

    # ------------------------------------------------------------------------------------------ records
    def _record(self, event: str, details: dict[str, Any]) -> None:
        if not self.strategy.is_global_zero:
            return
        with contextlib.suppress(OSError):
            path = self.run_info.path("checkpoints", "recovery", f"attempt-{self.run_info.attempt}.json")
            entries = json.loads(path.read_text()) if path.exists() else []
            entries.append({"event": event, "unix": time.time(), **details})
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(entries, indent=1))
            os.replace(tmp, path)

    # ------------------------------------------------------------------------------------------ end
    def close(self, finished: bool = True) -> None:
        """Wait for what is in flight; with ``finished`` (training is done), the node's memory snapshots are released
        once every local rank said so. Call on every rank."""
        if self._closed:
            return
        self.wait()
        if self.compile_cache and not self._compile_stored:
            self._store_compile_cache()
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self.preemption is not None:
            self.preemption.uninstall()
        if finished and self._keeper is not None:
            with contextlib.suppress(OSError, keeper.KeeperError):
                self._keeper.request("finished", key=self.key, ranks=self.strategy.topology.processes_per_node)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        tiers = []
        if self.memory_every is not None:
            tiers.append(f"memory every {self.memory_every}" + (" (off)" if self.memory_error else ""))
        if self.disk is not None:
            tiers.append(f"disk {self.disk} every {self.disk_every}")
        if self.remote is not None:
            tiers.append(f"remote {self.remote} every {self.remote_every}")
        return f"CheckpointTiers({', '.join(tiers)})"


def _gate_hook(ref: weakref.ReferenceType[CheckpointTiers]) -> Callable[..., None]:
    def hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        tiers = ref()
        if tiers is not None:
            tiers._gate()

    return hook


def _finish_at_exit(ref: weakref.ReferenceType[CheckpointTiers]) -> None:
    tiers = ref()
    if tiers is not None and not tiers._closed:
        with contextlib.suppress(BaseException):
            tiers._finish_snapshot()


def _is_dataloader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader) or type(obj).__name__ in ("FabricDataLoader", "StatefulDataLoader")


def _complete(state: Mapping[str, Any], converted: Mapping[str, Any]) -> bool:
    """Whether this rank's converted state holds every model and optimizer whole (a strategy that gathers full state
    to rank 0 only leaves the others' empty)."""
    for key, obj in state.items():
        if isinstance(obj, Module) and any(True for _ in obj.parameters()) and not converted.get(key):
            return False
        if isinstance(obj, Optimizer) and obj.state and not (converted.get(key) or {}).get("state"):
            return False
    return True


def _filesystem(path: Path) -> str:
    try:
        size = store.filesystem_size(path)
    except OSError:
        return "unknown size"
    return f"a filesystem of {_size(size)}, {_size(store.free_bytes(path))} free"


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    """Bytes the cgroup v2 memory limit still allows (tmpfs pages count against it), or ``None`` without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def _size(n: float) -> str:
    return memory._size(n)
