"""A CPU backward before the XLA device is first used (pytorch/xla#4174): ``Fabric(accelerator="tpu")`` must say
what to do instead of every later XLA backward failing an internal assert. Writes ``order.json``.

    python autograd_order.py OUTDIR MODE      (MODE: cpu_backward_first | fabric_first)
"""

from __future__ import annotations

import sys
import time

import torch
from xla_common import dump, out_dir

from fabric_core import Fabric

out, mode = out_dir(), sys.argv[2]
result: dict = {"mode": mode}
if mode == "cpu_backward_first":
    torch.ones(2, requires_grad=True).sum().backward()  # e.g. a CPU warm-up or a test that ran first
    try:
        Fabric(accelerator="tpu", devices=1)
    except Exception as err:
        result.update(error_type=type(err).__name__, error=str(err), is_runtime_error=isinstance(err, RuntimeError))
        result["cause"] = f"{type(err.__cause__).__name__}: {err.__cause__}" if err.__cause__ else None
else:
    fabric = Fabric(accelerator="tpu", devices=1)
    from fabric_xla import runtime

    runtime._ORDER_CHECKED = False
    start = time.perf_counter()
    runtime.check_autograd_order(fabric.device)  # what the check costs when it runs
    result["probe_s"] = time.perf_counter() - start
    model = fabric.setup(torch.nn.Linear(4, 1))
    fabric.backward(model(torch.randn(2, 4, device=fabric.device)).sum())  # XLA backwards work afterwards
    torch.ones(2, requires_grad=True).sum().backward()  # and CPU ones too
    result["grad_on_xla"] = str(model.weight.grad.device)
dump(out / "order.json", result)
