from fabric_core.strategies import SingleDeviceStrategy


class GoodStrategy(SingleDeviceStrategy):
    pass
