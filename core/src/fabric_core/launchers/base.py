"""The launcher contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.strategies.base import Strategy


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
