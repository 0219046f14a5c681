"""Importing and wiring DeepSpeed so that it uses our process group, compiles nothing, and lets go at the end.

Measured with deepspeed 0.19.8 and torch 2.13 on the CPU (the README lists each internal used):

* ``DS_ACCELERATOR=cpu`` must be in the environment *before* the first ``import deepspeed`` (the accelerator is
  detected during that import; afterwards it can no longer be chosen cleanly). We set it only when the run is on
  the CPU and the user did not set it.
* DeepSpeed's communication backend wraps an existing ``torch.distributed`` group and, on the CPU accelerator,
  JIT-compiles its ``deepspeed_shm_comm`` op (~2 min, needs a C++ compiler) when
  ``deepspeed.ops.__compatible_ops__`` says it can. We give it a table that says it cannot (before the backend
  exists); DeepSpeed then uses plain torch collectives over our gloo group.
* DeepSpeed runs its collectives on a *clone* of the world group, created with torch's default timeout (30
  minutes), not the strategy's. We create that clone ourselves, with the strategy's timeout, so a stuck rank
  fails the job when the user asked for it.
* After the process group is destroyed, DeepSpeed's module-level references to its groups are stale: a later
  engine in the same process would fail ("Group ... is not registered"). :func:`release_groups` drops them.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from datetime import timedelta
from types import ModuleType
from typing import Any

ACCELERATOR_VARIABLE = "DS_ACCELERATOR"
#: The FutureWarnings torch 2.13 emits from DeepSpeed's collectives, on every step. torch attributes them to its
#: own logging wrapper, so the filter cannot tell DeepSpeed's calls from the user's: it hides these two messages for
#: the whole process once a DeepSpeed strategy runs (documented in the README).
_DEPRECATED_COLLECTIVES = r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def _accelerator_name(deepspeed: ModuleType) -> str:
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def import_deepspeed(device_type: str, logging_level: int | None = None) -> ModuleType:
    """``import deepspeed`` for a run on ``device_type``, with the settings above; returns the module.

    Raises ``RuntimeError`` when deepspeed was imported earlier with an accelerator of another device type.
    """
    if "deepspeed" not in sys.modules and device_type == "cpu":
        os.environ.setdefault(ACCELERATOR_VARIABLE, "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as err:  # pragma: no cover - the distribution depends on deepspeed
        raise ImportError(
            f"fabric-deepspeed needs the `deepspeed` package: `pip install deepspeed`. ({type(err).__name__}: {err})"
        ) from err
    accelerator = _accelerator_name(deepspeed)
    if accelerator != device_type:
        raise RuntimeError(
            f"DeepSpeed was imported with its {accelerator!r} accelerator, but Fabric runs on {device_type!r}."
            f" DeepSpeed picks its accelerator when it is first imported: set `{ACCELERATOR_VARIABLE}={device_type}`"
            " before anything imports deepspeed, or import it after creating the `Fabric` object."
        )
    ops = deepspeed.ops
    if "__compatible_ops__" not in vars(ops):
        # Read only by comm/torch.py:build_shm_op; assigning a table also skips DeepSpeed's op probe (0.2 s).
        ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    else:
        ops.__compatible_ops__["deepspeed_shm_comm"] = False
    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)
    if logging_level is not None:
        from deepspeed.utils import logger

        logger.setLevel(logging_level)
    return deepspeed


def import_for_reading() -> ModuleType:
    """``import deepspeed`` in a process that only reads checkpoints (no engine, any strategy).

    Reading needs no accelerator. Where DeepSpeed's detection would end on the CPU anyway (no CUDA, no MPS), the
    CPU accelerator is chosen up front, which skips the detection warning; elsewhere DeepSpeed detects as usual, so
    a DeepSpeed strategy on that device can still run in this process later.
    """
    if "deepspeed" not in sys.modules and ACCELERATOR_VARIABLE not in os.environ:
        import torch

        mps = getattr(torch.backends, "mps", None)
        if not torch.cuda.is_available() and not (mps is not None and mps.is_available()):
            os.environ[ACCELERATOR_VARIABLE] = "cpu"
    import deepspeed

    return deepspeed


def init_distributed(deepspeed: ModuleType, backend: str, timeout: timedelta | None, world_size: int) -> None:
    """Make DeepSpeed use the process group that exists already, with a world-group clone of ``timeout``.

    Every rank must call it at the same point (creating a group is a collective).
    """
    import torch.distributed as dist
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(world_size)), **kwargs)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False)


def release_groups() -> None:
    """Drop DeepSpeed's references to process groups (after the groups were destroyed); never raises."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if release is None:
        return
    try:
        release()
    except (AttributeError, TypeError, KeyError, RuntimeError):  # a DeepSpeed whose private teardown differs: best effort
        logging.getLogger(__name__).debug("DeepSpeed's group references could not be released", exc_info=True)


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``DeepSpeedEngine`` (False without importing deepspeed when it is not imported)."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    return engine_module is not None and isinstance(obj, engine_module.DeepSpeedEngine)
