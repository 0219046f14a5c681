from fabric_core.strategies.single_device import SingleDeviceStrategy


class GoodStrategy(SingleDeviceStrategy):
    pass
