"""Everything that touches the torch_xla runtime, in one module, imported only once an XLA name is in use.

The rules torch_xla imposes (measured on torch_xla 2.9, see the README):

* The runtime starts at the first XLA device use and cannot change afterwards: ``PJRT_DEVICE``, ``CPU_NUM_DEVICES``
  and SPMD mode (:func:`initialize`) must be settled before it, and ``torch_xla.launch`` refuses to start replicas
  in a process whose runtime is already running.
* A CPU ``backward()`` that runs before the runtime starts sizes the autograd engine's device queues without the
  XLA devices, and every later XLA backward then fails an internal assert (pytorch/xla#4174). The single-device
  and SPMD strategies therefore start the runtime as soon as ``Fabric(...)`` resolves them, and
  :func:`initialize` checks the order once per process with a one-element XLA backward (traced, never compiled):
  when a backward already ran, it raises :class:`XLAAutogradOrderError`, which says what to do, instead of the
  assert deep in autograd at the first training step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module


class XLAAutogradOrderError(RuntimeError):
    """A backward pass ran in this process before the XLA device was first used; XLA backwards cannot work here."""


AUTOGRAD_ORDER_MESSAGE = (
    "A backward pass ran in this process before the XLA device was first used, so PyTorch's autograd engine was set"
    " up without the XLA devices and every backward on XLA fails (torch_xla's internal assert on"
    " `device_ready_queues_`, pytorch/xla#4174). Create `Fabric(accelerator='tpu', ...)` (or call"
    " `torch_xla.device()`) before anything in this process calls `backward()`: move CPU warm-ups, checks or other"
    " training after it, or run the XLA training in a fresh process (for example a subprocess)."
)
_ORDER_CHECKED = False
_ORDER_LOCK = threading.Lock()


def check_autograd_order(device: torch.device) -> None:
    """Once per process: a one-element backward on ``device`` (traced, not compiled or run), turning torch_xla's
    internal assert after an earlier CPU backward into :class:`XLAAutogradOrderError`."""
    global _ORDER_CHECKED
    with _ORDER_LOCK:
        if _ORDER_CHECKED:
            return
        probe = torch.ones(1, device=device, requires_grad=True)
        try:
            (probe * 2).sum().backward()
        except RuntimeError as err:
            if "device_ready_queues_" in str(err):
                raise XLAAutogradOrderError(AUTOGRAD_ORDER_MESSAGE) from err
            raise
        _ORDER_CHECKED = True


def initialize(spmd: bool) -> torch.device:
    """Start the runtime (in SPMD mode if ``spmd``) and return this thread's default XLA device.

    Asking for SPMD after the runtime has started without it is refused: existing XLA tensors would be replicated
    silently, and a single-device strategy may already be using them. A backward that ran before the XLA device
    was first used is reported here (:func:`check_autograd_order`), not at the first training step.
    """
    import torch_xla
    import torch_xla.runtime as xr

    if spmd and not xr.is_spmd():
        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise RuntimeError(
                "The XLA runtime of this process was started without SPMD (an XLA tensor or another XLA strategy was"
                " used first), and SPMD must be chosen before that. Create `Fabric(strategy='xla_fsdp')` before"
                " anything touches the XLA device, or run the sharded part in a fresh process."
            )
        xr.use_spmd()
    device = torch_xla.device()
    check_autograd_order(device)
    return device


def is_initialized() -> bool:
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def sync() -> None:
    """Cut the lazy graph here and run it asynchronously (``torch_xla.sync()``)."""
    import torch_xla

    torch_xla.sync()


def global_device_count() -> int:
    """Devices of every host the runtime sees (what an SPMD mesh spans)."""
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def move_module(module: Module, device: torch.device) -> None:
    """``module.to(device)`` keeping every ``Parameter`` object, so optimizers built before still point at them.

    A CPU tensor and an XLA tensor have different implementations, so a plain ``.to()`` would replace each
    parameter with a new object. Swapping the tensors' contents instead (``torch.utils.swap_tensors``, switched on
    for this call only) keeps their identity.
    """
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def to_cpu(data: Any) -> Any:
    """``data`` with every XLA tensor (parameters too, sharded ones gathered whole) replaced by a CPU tensor.

    One graph execution and one batched transfer for all of them (``xm._maybe_convert_to_cpu``, what ``xm.save``
    uses); it selects plain ``torch.Tensor`` objects only, so parameters are detached first.
    """
    import torch.utils._pytree as pytree
    import torch_xla.core.xla_model as xm

    leaves, spec = pytree.tree_flatten(data)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.device.type == "xla"]
    if not positions:
        return data
    moved = xm._maybe_convert_to_cpu([leaves[i].detach() for i in positions])
    for i, tensor in zip(positions, moved):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)
