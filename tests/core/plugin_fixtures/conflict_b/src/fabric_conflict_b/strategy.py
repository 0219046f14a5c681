from fabric_core.strategies import SingleDeviceStrategy


class StrategyB(SingleDeviceStrategy):
    origin = "b"
