"""Which Ray cluster this machine would use, and whether it answers: for ``fabric env`` (no ``ray`` import, which
costs seconds; a TCP connect of at most :data:`TIMEOUT_S`)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

TIMEOUT_S = 2.0


def cluster_address() -> tuple[str | None, str]:
    """``(address, where it came from)``: ``RAY_ADDRESS``, else the cluster ``ray start`` last started on this
    machine (the file Ray writes in its temporary folder), else ``None``."""
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "auto":
        return address, "RAY_ADDRESS"
    folder = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
    try:
        found = (folder / "ray_current_cluster").read_text().strip()
    except OSError:
        found = ""
    return (found or None), f"started on this machine ({folder / 'ray_current_cluster'})"


def cluster_state() -> str:
    address, source = cluster_address()
    if address is None:
        return "none configured (RAY_ADDRESS is not set and no `ray start` cluster runs here)"
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} from {source} is not HOST:PORT"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S):
            pass
    except OSError as err:
        return f"NOT reachable at {address} from {source} ({err.strerror or err}, {TIMEOUT_S:g} s connect)"
    return f"reachable at {address} ({source})"
