from fabric_core.strategies import SingleDeviceStrategy


class StrategyA(SingleDeviceStrategy):
    origin = "a"
