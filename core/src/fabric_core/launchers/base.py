"""The launcher contract, and what ``fabric run`` hands a script launcher (:class:`ScriptRequest`)."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.strategies.base import Strategy

#: Set by ``fabric run`` (and :meth:`ScriptRequest.process_environment`) in every process it starts: the gate of the
#: ``FABRIC_*`` settings below, which ``Fabric(...)`` takes only where it is ``1``.
CLI_FLAG = "FABRIC_CLI_USED"
#: The ``Fabric(...)`` argument each variable that ``fabric run`` sets stands for.
CLI_SETTINGS = {
    "accelerator": "FABRIC_ACCELERATOR",
    "strategy": "FABRIC_STRATEGY",
    "devices": "FABRIC_DEVICES",
    "num_nodes": "FABRIC_NUM_NODES",
    "precision": "FABRIC_PRECISION",
}


def start_method_hint(strategy: Strategy, start_method: str) -> str:
    """How the user of ``strategy`` makes its processes start with ``start_method``, in words for an error message.

    Messages name the strategy in use, never a particular plugin's: a strategy built on the core's
    ``ParallelStrategy`` takes ``start_method=``; for any other, its own documentation says.
    """
    from fabric_core.strategies.parallel import ParallelStrategy

    name = type(strategy).__name__
    if isinstance(strategy, ParallelStrategy):
        return f"`{name}(start_method={start_method!r})` (or a registered name of it that starts processes that way)"
    return f"a strategy whose processes start with {start_method!r} (`{name}` cannot be switched by Fabric)"


class Launcher(ABC):
    """Starts the processes of a run and calls ``function`` in each.

    ``launch(function, *args, **kwargs)`` returns what the user's function returned in *this* process (or, for
    launchers that run the function only in children, rank 0's result).
    """

    #: True when the launcher can only run a function (spawned children cannot re-run the calling script).
    requires_function: bool = False
    #: True when it can be used from a notebook / ``python -i``.
    is_interactive_compatible: bool = False
    #: True when ``fabric run --launcher NAME`` can use it: :meth:`run_script` starts the whole job from one command
    #: (on a cluster scheduler, say), where the default, torch's elastic launcher, is run once per node.
    runs_scripts: bool = False

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the processes and run ``function(*args, **kwargs)`` in each."""

    @classmethod
    def run_script(cls, request: ScriptRequest) -> int:
        """Run ``request``'s script in all its processes and return the job's exit status (``runs_scripts`` only).

        A classmethod: ``fabric run`` has no strategy object; the script's own ``Fabric(...)`` builds one in each
        process. Print the first failure's rank and error (:mod:`fabric_core.runtime.failures`) and end the others.
        """
        raise NotImplementedError(f"{cls.__name__} cannot run a script (`runs_scripts` is False).")

    def teardown(self) -> None:  # noqa: B027 (optional hook)
        """Undo what launching changed in this process (exported variables), when the strategy is torn down."""


@dataclass
class ScriptRequest:
    """What ``fabric run --launcher NAME`` asks a script launcher to run (see :attr:`Launcher.runs_scripts`).

    The launcher starts ``processes_per_node * num_nodes`` processes wherever it places them, runs SCRIPT (or, with
    ``module``, ``python -m SCRIPT``) with ``script_args`` in each, started with :meth:`process_environment` (the
    CLI's settings and their gate, and the rank and rendezvous variables of that process); it streams their output
    and returns the job's exit status.
    """

    script: str
    script_args: list[str]
    module: bool
    processes_per_node: int
    num_nodes: int
    max_restarts: int
    #: the CLI's variables for every process (``FABRIC_CLI_USED``, ``FABRIC_DEVICES``, ``OMP_NUM_THREADS``, ...)
    environment: dict[str, str] = field(default_factory=dict)
    #: the launcher's own options, ``--NAME-KEY VALUE`` on the command line (``KEY`` with ``_`` for ``-``)
    options: dict[str, str] = field(default_factory=dict)
    #: the job's rendezvous id (``TORCHELASTIC_RUN_ID``): the same for every process and every restart
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def process_environment(
        self, node_rank: int, local_rank: int, main_address: str, main_port: int, *, restart: int = 0
    ) -> dict[str, str]:
        """Every variable the process ``local_rank`` on node ``node_rank`` must be started with, on top of its
        node's environment: the CLI's settings (:attr:`environment`) with their gate ``FABRIC_CLI_USED=1``, and what
        torchrun would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
        ``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` where rank 0 listens, ``TORCHELASTIC_RUN_ID``,
        ``TORCHELASTIC_RESTART_COUNT`` = ``restart``, ...). ``Fabric(...)`` in the script then joins the job as it
        does under ``fabric run`` with torchrun."""
        from fabric_core.utilities.topology import Topology

        if not 0 <= node_rank < self.num_nodes or not 0 <= local_rank < self.processes_per_node:
            raise ValueError(
                f"Process (node_rank={node_rank}, local_rank={local_rank}) is not part of this job of {self.num_nodes}"
                f" node(s) x {self.processes_per_node} process(es)."
            )
        topology = Topology(self.num_nodes, self.processes_per_node, node_rank, local_rank)
        return {
            **self.environment,
            CLI_FLAG: "1",
            **topology.environment(main_address, main_port, torchrun=True),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
        }
