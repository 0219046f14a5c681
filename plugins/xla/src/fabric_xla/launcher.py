"""``XLALauncher``: runs ``fabric.launch(fn)`` on every XLA device through ``torch_xla.launch``.

torch_xla starts one process per TPU chip (on a CPU host, and for TPU v2/v3 cores, one process whose replicas are
threads) and calls the function once per device; the launcher returns what rank 0's call returned. torch_xla
discards the results, so rank 0 writes its result (on the CPU) into a private temporary file that the launching
process reads back. Replicas that are threads of one process each get their own deep copy of the function and its
arguments (the ``Fabric`` object among them), so they do not share a strategy.

Only a function can be launched (``requires_function``): ``fabric run`` refuses the strategy, and
``fabric.launch()`` without a function raises the reference's ``TypeError``.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fabric_core.launchers import Launcher
from fabric_core.utilities import move_data_to_device

if TYPE_CHECKING:
    from fabric_xla.strategy import XLAStrategy


class _Replica:
    """What each replica runs (picklable: it travels to the spawned process)."""

    def __init__(self, function: Callable[..., Any], args: tuple, kwargs: dict, result_file: str) -> None:
        self.function, self.args, self.kwargs, self.result_file = function, args, kwargs, result_file

    def __call__(self, index: int) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        function, args, kwargs = self.function, self.args, self.kwargs
        if len(xm.get_xla_supported_devices()) > 1:  # replicas are threads of this process: one copy each
            function, args, kwargs = copy.deepcopy((function, args, kwargs))
        result = function(*args, **kwargs)
        if xr.global_ordinal() == 0:
            torch.save(move_data_to_device(result, "cpu"), self.result_file)


class XLALauncher(Launcher):
    """Launches the function on every device of this host with ``torch_xla.launch`` (``start_method="spawn"``)."""

    requires_function = True
    is_interactive_compatible = False

    def __init__(self, strategy: XLAStrategy, start_method: str = "spawn") -> None:
        super().__init__(strategy)
        self.start_method = start_method

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch_xla

        with tempfile.TemporaryDirectory(prefix="fabric-xla-") as folder:
            result_file = os.path.join(folder, "rank0-result.pt")
            replica = _Replica(function, args, kwargs, result_file)
            single = self.strategy.num_processes == 1  # type: ignore[attr-defined]
            torch_xla.launch(replica, start_method=self.start_method, debug_single_process=single)
            if not Path(result_file).exists():
                raise RuntimeError("The XLA replicas ended without rank 0 returning a result; see their output above.")
            return torch.load(result_file, weights_only=False)  # written by our own rank 0 just now
