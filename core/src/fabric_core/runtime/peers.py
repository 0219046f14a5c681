"""What the ranks' monitor threads tell each other, through the job's TCPStore: no collective, nothing on the
main thread, nothing that can hang training.

The store is the one the process group met at (``MASTER_ADDR:MASTER_PORT``: rank 0's under our launchers,
torchrun's agent under ``fabric run``); each monitor thread opens its own client to it, and every key is below
``fabric/monitor/<job>/<restart>/`` so attempts never read each other's. What goes through it:

* ``hb/<rank>``: each rank's heartbeat (every :data:`fabric_core.runtime.hang.HEARTBEAT_S` seconds): how long its
  main thread has made no progress, whether it is in user code, its section and limits, where it is;
* ``verdict``: global rank 0's reading of all heartbeats (a rank whose heartbeat stopped, every rank waiting);
* ``hang``: a named hang (by the stuck rank itself or by rank 0's verdict): every rank prints its stack once;
* ``chunk/<n>``: every rank appends its step marks of chunk ``n`` (:mod:`fabric_core.runtime.stragglers`); rank 0
  reads, analyses and deletes it;
* ``stragglers``: who rank 0 named, for every rank's ``on_straggler`` callbacks.

Every call here swallows the store's errors and returns ``None``/``False``: when rank 0's process (the store's host
under our launchers) is gone, the monitor goes on alone.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

#: Seconds a store request may take before the monitor gives up on it.
REQUEST_TIMEOUT_S = 10.0


class Peers:
    """This rank's client of the job's store (created on the monitor thread)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.failed = False

    @classmethod
    def connect(cls, job: str, restart: int, rank: int, world_size: int) -> Peers | None:
        """A client of the store at ``MASTER_ADDR:MASTER_PORT``, or ``None`` when there is none to reach."""
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size < 2 or not address or not port:
            return None
        try:
            import torch.distributed as dist

            store = dist.TCPStore(
                address, int(port), None, False, timedelta(seconds=REQUEST_TIMEOUT_S), wait_for_workers=False
            )
            prefixed = dist.PrefixStore(f"fabric/monitor/{job}/{restart}/", store)
        except (RuntimeError, OSError, ValueError):  # no store there (DistNetworkError, DistStoreError), a bad port
            return None
        return cls(prefixed, rank, world_size)

    # ------------------------------------------------------------------------------------------------ raw
    def _call(self, method: str, *args: Any) -> Any:
        if self.failed:
            return None
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, OSError):  # DistStoreError, DistNetworkError
            self.failed = True  # the store's host is gone (or stopped): go on alone
            return None

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, json.dumps(value))

    def get(self, key: str) -> Any:
        """The value at ``key``, or ``None`` when it is not there (never waits for it)."""
        if not self._call("check", [key]):
            return None
        raw = self._call("get", key)
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return None

    def get_many(self, keys: list[str]) -> list[Any] | None:
        """The values at ``keys`` when all are there, else ``None``."""
        if not keys or not self._call("check", keys):
            return None
        raw = self._call("multi_get", keys)
        if raw is None:
            return None
        try:
            return [json.loads(value) for value in raw]
        except ValueError:
            return None

    # ------------------------------------------------------------------------------------------------ uses
    def heartbeat(self, beat: dict[str, Any]) -> None:
        self.set(f"hb/{self.rank}", beat)

    def heartbeats(self) -> list[Any] | None:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        found = self._call("check", keys)
        if found:
            return self.get_many(keys)
        # Some rank has not beaten yet (still starting): read those that did, one by one.
        beats = []
        for key in keys:
            beats.append(self.get(key))
            if self.failed:
                return None
        return beats

    def append_chunk(self, index: int, payload: dict[str, Any]) -> None:
        self._call("append", f"chunk/{index}", json.dumps(payload) + "\n")

    def read_chunk(self, index: int) -> list[dict[str, Any]] | None:
        """Every rank's entry of chunk ``index`` once all ranks appended theirs (then the key is deleted)."""
        key = f"chunk/{index}"
        if not self._call("check", [key]):
            return None
        raw = self._call("get", key)
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        entries = []
        for line in text.splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
        if len(entries) < self.world_size:
            return None
        self._call("delete_key", key)
        return entries

    def drop_chunk(self, index: int) -> None:
        self._call("delete_key", f"chunk/{index}")


__all__ = ["Peers"]
