"""The launcher contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.strategies.base import Strategy


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
    ``module``, ``python -m SCRIPT``) with ``script_args`` in each, with ``environment`` set there (the CLI's
    ``FABRIC_*`` settings, so ``Fabric(...)`` in the script takes them) plus the rank and rendezvous variables the
    launcher chooses; it streams their output and returns the job's exit status.
    """

    script: str
    script_args: list[str]
    module: bool
    processes_per_node: int
    num_nodes: int
    max_restarts: int
    #: variables to set in every process (``FABRIC_CLI_USED``, ``FABRIC_DEVICES``, ``OMP_NUM_THREADS``, ...)
    environment: dict[str, str] = field(default_factory=dict)
    #: the launcher's own options, ``--NAME-KEY VALUE`` on the command line (``KEY`` with ``_`` for ``-``)
    options: dict[str, str] = field(default_factory=dict)
