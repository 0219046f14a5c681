"""What runs beside a training run once its processes are started (the run's own machinery, not its model or data).

* :mod:`~fabric_core.runtime.hang`: the monitor thread: hang detection (by default for several processes;
  ``FABRIC_HANG_TIMEOUT``), the goodput ledger's records and the straggler marks, through
  :mod:`~fabric_core.runtime.peers` (the job's store) and :mod:`~fabric_core.runtime.stragglers`;
* :mod:`~fabric_core.runtime.goodput`: the goodput ledger (where every rank's time goes) and its hot path;
  :mod:`~fabric_core.runtime.goodput_report` reads its records (``fabric goodput``);
* :mod:`~fabric_core.runtime.chaos`: faults a rank injects on ``fabric chaos``'s schedule;
* :mod:`~fabric_core.runtime.failures`: a failed rank's error carried to the end of the job's output;
* :mod:`~fabric_core.runtime.process_group`: ending a process that used ``torch.distributed`` cleanly;
* :mod:`~fabric_core.runtime.progress`: a progress bar that only global rank 0 shows;
* :mod:`~fabric_core.runtime.throughput`: throughput and model FLOPs utilisation;
* :mod:`~fabric_core.runtime.resume`: resuming a run (every rank's random generators, the newest checkpoint);
* :mod:`~fabric_core.runtime.run`: the run's identity (run id, attempt number) and its folder.

It stands beside :mod:`fabric_core.io` and imports only that and :mod:`fabric_core.utilities`, so strategies,
launchers and the wrappers below the facade can use it. Modules are imported where used (nothing here).
"""
