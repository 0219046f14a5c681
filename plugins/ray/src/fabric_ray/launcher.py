"""``fabric run --launcher ray``: a whole Fabric job on a Ray cluster from one command, no SSH, no per-node command.

The driver (the ``fabric run`` process) connects to the cluster (``--ray-address HOST:PORT`` or ``RAY_ADDRESS``),
reserves one bundle per node in a placement group (``STRICT_SPREAD``: every node on a different Ray node; ``--devices``
CPUs, or GPUs with ``--accelerator cuda/gpu``, per bundle), starts one small actor per process in its node's bundle,
and each actor runs the script as a child process with the variables torchrun would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0's node,
``TORCHELASTIC_RUN_ID``...) plus ``fabric run``'s ``FABRIC_*`` settings. So ``Fabric(...)`` in the script joins exactly
as under ``fabric run`` with torchrun (its torchelastic environment): a script runs unchanged under either.

The driver streams every rank's output prefixed with ``[rank R]``; when a rank fails it stops the others (SIGTERM, then
SIGKILL), prints the first failure with that rank's own error (:mod:`fabric_core.runtime.failures`) and exits with its
code; ``--max-restarts N`` runs the whole job again up to N times on fresh actors (``TORCHELASTIC_RESTART_COUNT`` says
which attempt). Bad input fails fast: an address nobody listens on is refused within seconds, a placement the cluster
cannot hold names its nodes, and one it cannot hold *now* waits ``--ray-placement-timeout`` seconds (default 60).

``fabric.launch(fn)`` with ``DDPStrategy(start_method="ray")`` (any strategy on the core's ``ParallelStrategy``) places
the processes the same way and runs the function in the actors, returning rank 0's result (:meth:`RayLauncher.launch`).

The launcher's options (``--ray-KEY VALUE`` before SCRIPT): ``address``, ``placement_timeout``, ``node_ip`` (this
machine's address as the cluster sees it, needed only when it has several; for a loopback address it is that
address), ``env`` (the driver's variables every process gets, see :func:`forwarded_environment`), ``working_dir``
(a folder Ray copies to every node; the script runs from that copy). ``ray`` is imported only when a job starts.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fabric_core.environments import find_free_port
from fabric_core.launchers import (
    Launcher,
    RankFailure,
    RecordedError,
    ScriptRequest,
    job_exit_code,
    rank_failure,
    report_failures,
    start_rank_process,
    stop_processes,
)
from fabric_core.strategies import Topology

#: Seconds a TCP connection to the cluster's address may take before the cluster counts as unreachable.
CONNECT_TIMEOUT_S = 5.0
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
#: Seconds between two collections of the workers' output; a failure is noticed within this.
POLL_S = 0.2
#: Seconds the other ranks get to end after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
OPTIONS = ("address", "placement_timeout", "node_ip", "env", "working_dir")
#: The driver's variables to forward when ``--ray-env`` is not given (the only way to name them for ``launch(fn)``).
ENV_VARIABLE = "FABRIC_RAY_ENV"
#: Set in every process: the address of the Ray node it runs on (for the script's own logs).
NODE_IP_VARIABLE = "FABRIC_RAY_NODE_IP"


class LaunchError(RuntimeError):
    """The job cannot start (no cluster, a placement the cluster cannot hold, a bad option); the message says why."""


class RayLauncher(Launcher):
    """Run a script (``fabric run --launcher ray``) or a function (``fabric.launch(fn)`` with ``start_method="ray"``) on
    every process of a job placed on a Ray cluster."""

    runs_scripts = True
    requires_function = True  # under `fabric.launch`: the function travels to the actors, the script does not

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """``fabric.launch(fn)`` with a strategy whose ``start_method`` is ``"ray"``: run ``fn`` in one Ray actor per
        process, placed as ``fabric run --launcher ray`` places them, and return rank 0's result. A failing rank ends
        the others, and its own error (Ray's ``RayTaskError`` with the rank's traceback) is raised here."""
        strategy = self.strategy
        devices = getattr(strategy, "parallel_devices", None) or []
        accelerator = "cuda" if devices and getattr(devices[0], "type", "cpu") == "cuda" else "cpu"
        request = ScriptRequest(
            script="",
            script_args=[],
            module=False,
            processes_per_node=strategy.num_processes,
            num_nodes=strategy.num_nodes,
            max_restarts=0,
            environment={"FABRIC_ACCELERATOR": accelerator},
        )
        job = _Job(request)  # RAY_ADDRESS, checked within seconds
        job.connect(log_to_driver=True)  # the actors' output, prefixed by Ray with each one's rank
        try:
            job.place()
            return job.run_function(strategy, function, args, kwargs)
        finally:
            import ray

            job.release()
            ray.shutdown()

    @classmethod
    def run_script(cls, request: ScriptRequest) -> int:
        try:
            job = _Job(request)
        except LaunchError as err:
            print(f"fabric run --launcher ray: error: {err}", file=sys.stderr, flush=True)
            return 2
        return job.run()


# --------------------------------------------------------------------------------------------------- the driver
def _options(request: ScriptRequest) -> tuple[str | None, float, str | None]:
    unknown = sorted(set(request.options) - set(OPTIONS))
    if unknown:
        raise LaunchError(
            f"unknown option(s) {', '.join('--ray-' + k.replace('_', '-') for k in unknown)}; the ray launcher takes"
            f" {', '.join('--ray-' + k.replace('_', '-') for k in OPTIONS)}."
        )
    address = request.options.get("address") or os.environ.get("RAY_ADDRESS") or None
    try:
        timeout = float(request.options.get("placement_timeout", DEFAULT_PLACEMENT_TIMEOUT_S))
    except ValueError:
        raise LaunchError(f"--ray-placement-timeout takes seconds, got {request.options['placement_timeout']!r}.") from None
    node_ip = request.options.get("node_ip")
    if node_ip is None and address:
        host = _host_port(address)[0]
        if host and _is_loopback(host):
            node_ip = host  # a cluster on loopback: this driver is one of its machines, seen at that address
    return address, timeout, node_ip


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Set by the launcher in every process; forwarding them would give every rank the driver's value.
_LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "CUDA_VISIBLE_DEVICES", NODE_IP_VARIABLE,
)  # fmt: skip


def forwarded_environment(spec: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables ``--ray-env SPEC`` (or ``FABRIC_RAY_ENV``) gives every process of the job.

    A Ray worker inherits the environment its node's Ray was started with, not the driver's: a key the user exported
    before ``fabric run`` (``WANDB_API_KEY``, ``HF_TOKEN``) is not there unless forwarded. SPEC is comma-separated:
    ``NAME`` (the driver's value; an error when the driver has none), ``NAME=VALUE`` (that value), or a pattern with
    ``*`` (every driver variable it matches, ``WANDB_*``; none is fine). The launcher's own per-process variables
    (``RANK``, ``MASTER_ADDR``...) cannot be forwarded."""
    environ = dict(os.environ if environ is None else environ)
    found: dict[str, str] = {}
    for item in (part.strip() for part in (spec or "").split(",")):
        if not item:
            continue
        name, has_value, value = item.partition("=")
        name = name.strip()
        if "*" in name and not has_value:
            found.update({k: v for k, v in environ.items() if fnmatch.fnmatchcase(k, name) and k not in _LAUNCHER_VARIABLES})
            continue
        if not _NAME.fullmatch(name):
            raise LaunchError(f"--ray-env: {item!r} is not NAME, NAME=VALUE or a pattern such as WANDB_*.")
        if name in _LAUNCHER_VARIABLES:
            raise LaunchError(f"--ray-env: {name} is set by the launcher for each process; it cannot be forwarded.")
        if has_value:
            found[name] = value
        elif name in environ:
            found[name] = environ[name]
        else:
            raise LaunchError(
                f"--ray-env names {name}, which is not set here; export it before `fabric run`, or give it as"
                f" {name}=VALUE."
            )
    return found


def _working_dir(request: ScriptRequest) -> str | None:
    """``--ray-working-dir DIR``: the folder Ray copies to every node (its ``runtime_env`` ``working_dir``; Ray's
    limits apply, such as its size cap). The script must be inside it, and runs from the copy with it as the current
    folder, so a cluster without a shared file system needs no per-node copy."""
    given = request.options.get("working_dir")
    if not given:
        return None
    folder = os.path.abspath(given)
    if not os.path.isdir(folder):
        raise LaunchError(f"--ray-working-dir {given!r} is not a folder.")
    if not request.module:
        script = os.path.abspath(request.script)
        if os.path.commonpath([script, folder]) != folder:
            raise LaunchError(
                f"the script {request.script!r} is not inside --ray-working-dir {given!r}: Ray copies only that folder"
                " to the nodes. Give the folder that holds the script (and what it imports)."
            )
        if not os.path.isfile(script):
            raise LaunchError(f"the script {request.script!r} does not exist.")
    return folder


def _host_port(address: str) -> tuple[str | None, int | None]:
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None, None
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_reachable(address: str) -> None:
    """Refuse within seconds an address nobody listens on (Ray itself retries for a minute or more)."""
    host, port = _host_port(address)
    if host is None or port is None:
        if address == "auto":
            return  # Ray looks for a cluster started on this machine, and says quickly when there is none
        raise LaunchError(f"the Ray address {address!r} is not HOST:PORT (or ray://HOST:PORT, or 'auto').")
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise LaunchError(
            f"cannot reach the Ray cluster at {address!r} ({err.strerror or err} within {CONNECT_TIMEOUT_S:g} s)."
            " Start one (`ray start --head`) or give the head node's address: `--ray-address HOST:PORT` or"
            " RAY_ADDRESS=HOST:PORT."
        ) from None


def node_bundle(processes_per_node: int, gpu: bool) -> dict[str, float]:
    """The placement-group bundle of one node: a CPU per process, or (``--accelerator cuda``) a GPU and a CPU each."""
    return {"GPU": float(processes_per_node), "CPU": float(processes_per_node)} if gpu else {"CPU": float(processes_per_node)}


def actor_resources(gpu: bool) -> dict[str, int]:
    """What each process's actor takes from its node's bundle: its GPU (Ray sets its ``CUDA_VISIBLE_DEVICES``), or a
    CPU."""
    return {"num_cpus": 0, "num_gpus": 1} if gpu else {"num_cpus": 1, "num_gpus": 0}


@dataclass
class _Rank:
    rank: int
    node: int
    local: int
    actor: Any = None
    pid: int | None = None
    exit: tuple[int, Any, bool] | None = None  # (code, recorded error, stopped by us)
    output_open: bool = True


@dataclass
class _Job:
    request: ScriptRequest
    address: str | None = None
    timeout: float = DEFAULT_PLACEMENT_TIMEOUT_S
    node_ip: str | None = None
    gpu: bool = False
    forwarded: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    group: Any = None
    ranks: list[_Rank] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.address, self.timeout, self.node_ip = _options(self.request)
        self.forwarded = forwarded_environment(self.request.options.get("env", os.environ.get(ENV_VARIABLE)))
        self.working_dir = _working_dir(self.request)
        if self.address:
            check_reachable(self.address)
        accelerator = self.request.environment.get("FABRIC_ACCELERATOR", "cpu").lower()
        self.gpu = accelerator in ("cuda", "gpu")

    # ---------------------------------------------------------------------------------------------- lifecycle
    def connect(self, log_to_driver: bool = False) -> None:
        import ray

        try:
            ray.init(
                address=self.address,
                _node_ip_address=self.node_ip,
                logging_level="ERROR",
                log_to_driver=log_to_driver,  # a script's output comes through this driver, prefixed with the rank
                configure_logging=False,
                # Ray uploads a local folder only for the whole job; it starts every actor in its node's copy
                runtime_env={"working_dir": self.working_dir} if self.working_dir else None,
            )
        except Exception as err:  # ray.init raises what its connection, upload and runtime layers raise, typed by none
            upload = f" (or upload --ray-working-dir {self.working_dir!r})" if self.working_dir else ""
            raise LaunchError(f"cannot connect to Ray at {self.address or 'auto'!r}{upload}: {err}") from err

    def run(self) -> int:
        import ray

        try:
            self.connect()
        except LaunchError as err:
            print(f"fabric run --launcher ray: error: {err}", file=sys.stderr, flush=True)
            return 2
        try:
            try:
                self.place()
            except LaunchError as err:
                print(f"fabric run --launcher ray: error: {err}", file=sys.stderr, flush=True)
                return 2
            attempt = 0
            while True:
                code = self._attempt(attempt)
                if code == 0 or attempt >= self.request.max_restarts:
                    return code
                attempt += 1
                print(
                    f"[fabric] restarting all {len(self.ranks)} workers (restart {attempt} of"
                    f" {self.request.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
        except KeyboardInterrupt:
            self._stop_all()
            return 130
        finally:
            self.release()
            ray.shutdown()

    def place(self) -> None:
        """One bundle per node, each on a different Ray node, with room for that node's processes."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        per_node, nodes = self.request.processes_per_node, self.request.num_nodes
        resource = "GPU" if self.gpu else "CPU"
        bundle = node_bundle(per_node, self.gpu)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        fitting = [n for n in alive if n.get("Resources", {}).get(resource, 0) >= per_node]
        if len(fitting) < nodes:
            seen = ", ".join(
                f"{n.get('NodeManagerAddress')} ({n.get('Resources', {}).get(resource, 0):g} {resource})" for n in alive
            )
            raise LaunchError(
                f"`--num-nodes {nodes} --devices {per_node}` needs {nodes} Ray node(s) with {per_node} {resource} each"
                f" (one worker per device, every node on its own Ray node), but the cluster has {len(fitting)} such"
                f" node(s): {seen or 'none alive'}. Ask for fewer, or add nodes (`ray start --address ...`)."
            )
        strategy = "STRICT_SPREAD" if nodes > 1 else "PACK"
        self.group = placement_group([dict(bundle) for _ in range(nodes)], strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            self.group = None
            raise LaunchError(
                f"the cluster could not place {nodes} node(s) x {per_node} {resource} ({strategy}) within"
                f" {self.timeout:g} s: its nodes are big enough, but busy (other jobs hold their {resource}s)."
                " Wait for them, or raise --ray-placement-timeout SECONDS."
            ) from None

    def _attempt(self, attempt: int) -> int:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_node, nodes = self.request.processes_per_node, self.request.num_nodes
        worker = ray.remote(_Worker)
        self.ranks = []
        for node in range(nodes):
            for local in range(per_node):  # global ranks node by node, as torchrun numbers them
                options: dict[str, Any] = {
                    **actor_resources(self.gpu),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=node),
                }
                rank = _Rank(len(self.ranks), node, local)
                rank.actor = worker.options(**options).remote()
                self.ranks.append(rank)
        info = ray.get([r.actor.describe.remote() for r in self.ranks], timeout=300)
        master_addr, master_port = info[0]["ip"], ray.get(self.ranks[0].actor.free_port.remote(), timeout=60)
        gpus_by_node: dict[int, list[str]] = {}
        for rank, found in zip(self.ranks, info):
            gpus_by_node.setdefault(rank.node, []).extend(found["gpus"])
        starts = []
        for rank, found in zip(self.ranks, info):
            env = {
                **self.forwarded,
                **self.request.process_environment(rank.node, rank.local, master_addr, master_port, restart=attempt),
                NODE_IP_VARIABLE: found["ip"],
            }
            if self.gpu:  # every local rank sees its node's GPUs, in local-rank order, as under torchrun
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus_by_node[rank.node])
            cwd = "" if self.working_dir else os.getcwd()  # "": the actor's own folder, Ray's copy
            starts.append(rank.actor.start.remote(self._command(), env, cwd))
        for rank, pid in zip(self.ranks, ray.get(starts, timeout=120)):
            rank.pid = pid
        return self._watch()

    def run_function(self, strategy: Any, function: Any, args: tuple, kwargs: dict) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_node, nodes = self.request.processes_per_node, self.request.num_nodes
        worker = ray.remote(_FunctionWorker)
        self.ranks = []
        for node in range(nodes):
            for local in range(per_node):  # global ranks node by node
                rank = _Rank(len(self.ranks), node, local)
                rank.actor = worker.options(
                    **actor_resources(self.gpu),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=node),
                ).remote(rank.rank)
                self.ranks.append(rank)
        info = ray.get([r.actor.describe.remote() for r in self.ranks], timeout=300)
        master_port = ray.get(self.ranks[0].actor.free_port.remote(), timeout=60)
        refs = {}
        for rank, found in zip(self.ranks, info):
            place = Topology(nodes, per_node, rank.node, rank.local)
            env = {**self.forwarded, **place.environment(info[0]["ip"], master_port), NODE_IP_VARIABLE: found["ip"]}
            # one argument: pickled together, the function's Fabric and `strategy` stay one object in the actor
            refs[rank.actor.run.remote((strategy, function, args, kwargs), env, rank.local)] = rank
        result, pending = None, list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                value = ray.get(done[0])
            except ray.exceptions.RayError:  # the first rank that failed: its own error (RayTaskError: its traceback)
                self._kill_actors()
                raise
            if refs[done[0]].rank == 0:
                result = value
        return result

    def _command(self) -> list[str]:
        if self.request.module:
            target = ["-m", self.request.script]
        elif self.working_dir:  # the same file, in Ray's copy of the folder
            target = [os.path.relpath(os.path.abspath(self.request.script), self.working_dir)]
        else:
            target = [os.path.abspath(self.request.script)]
        return [*target, *self.request.script_args]

    def _watch(self) -> int:
        """Stream output until every rank ended; stop the others at the first failure; return the job's code."""
        import ray

        stopping = False
        while any(r.exit is None or r.output_open for r in self.ranks):
            live = [r for r in self.ranks if r.exit is None or r.output_open]
            refs = [r.actor.poll.remote() for r in live]
            for rank, ref in zip(live, refs):
                try:
                    lines, ended = ray.get(ref, timeout=120)
                except (ray.exceptions.RayError, ConnectionError) as err:  # the actor (its node) died, or the cluster left
                    lines, ended = [], (1, RecordedError(f"the Ray worker died: {type(err).__name__}", str(err), time.time_ns()), False)
                for stream, line in lines:
                    target = sys.stderr if stream == 2 else sys.stdout
                    target.write(f"[rank {rank.rank}] {line}")
                if ended is not None:
                    rank.exit, rank.output_open = ended, False
            sys.stdout.flush()
            sys.stderr.flush()
            failed = [r for r in self.ranks if r.exit is not None and r.exit[0] != 0]
            if failed and not stopping:
                stopping = True
                for rank in self.ranks:
                    if rank.exit is None:
                        rank.actor.stop.remote(STOP_GRACE_S)
            time.sleep(POLL_S)
        found = []
        for rank in self.ranks:
            code, error, _stopped = rank.exit  # type: ignore[misc]
            if code != 0:  # those the driver stopped (SIGTERM, no error) are listed last by report_failures
                label = f"Rank {rank.rank} (node rank {rank.node}, local rank {rank.local})"
                found.append(RankFailure(label, rank.pid, code, error))
        self._kill_actors()
        if not found:
            return 0
        sys.stderr.write(report_failures(found))
        sys.stderr.flush()
        return job_exit_code(found)

    def _stop_all(self) -> None:
        import ray

        for rank in self.ranks:
            if rank.actor is not None and rank.exit is None:
                try:
                    rank.actor.stop.remote(STOP_GRACE_S)
                except ray.exceptions.RayError:
                    pass  # its actor is gone, and its script with it (PR_SET_PDEATHSIG)

    def _kill_actors(self) -> None:
        import ray

        for rank in self.ranks:
            if rank.actor is not None:
                try:
                    ray.kill(rank.actor)
                except (ray.exceptions.RayError, ValueError):
                    pass  # already dead
                rank.actor = None

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if any(r.actor is not None for r in self.ranks):
            try:  # the children end with their actor's process (PR_SET_PDEATHSIG); give them the grace period
                ray.get([r.actor.stop.remote(STOP_GRACE_S) for r in self.ranks if r.actor is not None], timeout=STOP_GRACE_S + 10)
            except ray.exceptions.RayError:
                pass  # an actor that died (or did not answer in time) is killed below
        self._kill_actors()
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


# --------------------------------------------------------------------------------------------------- the worker
class _Worker:
    """One process of the job: a Ray actor that runs the script as its child and hands its output to the driver."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._lines: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._readers: list[threading.Thread] = []
        self._error_file = ""
        self._stopped = False

    def describe(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        return find_free_port()

    def start(self, command: list[str], env: dict[str, str], cwd: str) -> int:
        import tempfile

        self._error_file = os.path.join(tempfile.mkdtemp(prefix="fabric-ray-"), "error.json")
        environ = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        # its own process group, dying with its actor (ray.kill, a lost node): no script outlives it
        self._process = start_rank_process(
            [sys.executable, *command],
            environ,
            self._error_file,
            cwd=cwd if os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for number, stream in ((1, self._process.stdout), (2, self._process.stderr)):
            reader = threading.Thread(target=self._read, args=(number, stream), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self._process.pid

    def _read(self, number: int, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            self._lines.put((number, raw.decode(errors="replace")))
        stream.close()

    def poll(self) -> tuple[list[tuple[int, str]], tuple[int, Any, bool] | None]:
        """New output lines, and (once the child ended and its output was read) its exit code, error and whether the
        driver stopped it."""
        assert self._process is not None
        code = self._process.poll()
        done = code is not None and not any(r.is_alive() for r in self._readers)
        lines = []
        while True:
            try:
                lines.append(self._lines.get_nowait())
            except queue.Empty:
                break
        if not done:
            return lines, None
        ended = rank_failure("", self._process, self._error_file)  # its shell-style status and recorded exception
        return lines, (ended.exit_code, ended.error, self._stopped)

    def stop(self, grace: float) -> None:
        """SIGTERM to the child's process group, SIGKILL after ``grace`` seconds."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        self._stopped = True
        stop_processes([process], grace)


class _FunctionWorker:
    """One process of a ``fabric.launch(fn)`` job: a Ray actor that takes its rank and runs the function."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:  # Ray prefixes the actor's output with this
        return f"rank {self.rank}"

    describe = _Worker.describe
    free_port = _Worker.free_port

    def stop(self, grace: float) -> None:
        """Nothing to stop: the function runs in this actor, which the driver kills."""

    def run(self, payload: tuple, env: dict[str, str], local_rank: int) -> Any:
        from fabric_core.strategies import release_process_group

        strategy, function, args, kwargs = payload
        os.environ.update(env)
        environment = strategy.cluster_environment
        if environment is not None:  # the ranks this actor stands for (as the core's spawn launcher does)
            topology = strategy.configured_topology.with_local_rank(local_rank)
            environment.set_global_rank(topology.global_rank)
            environment.set_world_size(topology.world_size)
        result = function(*args, **kwargs)
        release_process_group()
        return result if self.rank == 0 else None
