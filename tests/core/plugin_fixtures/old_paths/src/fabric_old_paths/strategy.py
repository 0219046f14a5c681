"""A strategy of the old plugin: the core's single-device strategy, plus what it read from the old failures path."""

from fabric_core.launchers.failures import exit_description
from fabric_core.strategies.single_device import SingleDeviceStrategy


class OldPathsStrategy(SingleDeviceStrategy):
    """One device; names a killed process's exit code the way ``fabric run`` does."""

    def describe_exit(self, code: int) -> str:
        return exit_description(code)
