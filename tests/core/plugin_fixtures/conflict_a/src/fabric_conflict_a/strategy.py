from fabric_core.strategies.single_device import SingleDeviceStrategy


class StrategyA(SingleDeviceStrategy):
    origin = "a"
