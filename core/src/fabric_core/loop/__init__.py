"""Helpers for the training loop that users of other loops expect (HF Accelerate, torchtitan, the Lightning
Trainer), working for every strategy, sharded ones included:

* :mod:`.accumulate`: ``with fabric.accumulate(model, n) as step:``, gradient accumulation over micro-batches;
* :mod:`.ema`: :class:`~fabric_core.loop.ema.EMA`, an exponential moving average of the weights, saved in
  checkpoints, with a context to evaluate with the averaged weights;
* :mod:`.profile`: ``with fabric.profile(...)``, ``torch.profiler`` per rank with a rank-zero summary;
* :mod:`.compile`: :func:`~fabric_core.loop.compile.compile_blocks`, ``torch.compile`` per repeated block.

Each is a module of its own; ``Fabric`` only delegates to them.
"""

from fabric_core.loop.accumulate import accumulate
from fabric_core.loop.profile import profile

__all__ = ["accumulate", "profile"]
