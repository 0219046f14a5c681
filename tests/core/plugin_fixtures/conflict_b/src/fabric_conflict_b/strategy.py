from fabric_core.strategies.single_device import SingleDeviceStrategy


class StrategyB(SingleDeviceStrategy):
    origin = "b"
