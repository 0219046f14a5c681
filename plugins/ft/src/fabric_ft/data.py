"""The data position of a job of replica groups (filled in below)."""

from __future__ import annotations

from typing import Any


class ReplicatedPosition:
    """Placeholder."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.steps_dropped = 0
        self.samples_requeued = 0

    def register(self, manager: Any) -> None:
        pass

    def before_quorum(self) -> None:
        pass

    def before_commit(self) -> None:
        pass

    def after_commit(self, committed: bool) -> None:
        if not committed:
            self.steps_dropped += 1
