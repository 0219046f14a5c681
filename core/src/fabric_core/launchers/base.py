"""The launcher contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the processes and run ``function(*args, **kwargs)`` in each."""

    def teardown(self) -> None:  # noqa: B027 (optional hook)
        """Undo what launching changed in this process (exported variables), when the strategy is torn down."""
