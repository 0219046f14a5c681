"""The lighthouse this machine's replica groups would use, and its current quorum: for ``fabric env`` (no torchft
import; one HTTP request of at most :data:`TIMEOUT_S` to the lighthouse's own status page)."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request

from fabric_ft.variables import LIGHTHOUSE_VARIABLE

TIMEOUT_S = 2.0


def lighthouse_state(address: str | None = None) -> str:
    """One line: where the lighthouse is, whether it answers, the last quorum (its id, its replica groups and their
    step) and how many groups send heartbeats."""
    address = address or os.environ.get(LIGHTHOUSE_VARIABLE)
    if not address:
        return f"none configured ({LIGHTHOUSE_VARIABLE} is not set; `fabric run --launcher ft` starts one per job)"
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=TIMEOUT_S) as answer:
            page = answer.read().decode("utf-8", "replace")
    except (OSError, ValueError) as err:  # refused, timed out, not a URL
        reason = getattr(err, "reason", None) or err
        return f"NOT reachable at {address} ({reason}; {TIMEOUT_S:g} s timeout)"
    return f"reachable at {address}: {describe_status(page)}"


def describe_status(page: str) -> str:
    """The quorum and heartbeats on the lighthouse's status page (torchft 0.2.0's HTML), in words."""
    quorum = re.search(r"Current quorum_id:\s*(\d+)", page)
    members = re.findall(r"<b>([^<:]+):[^<]*</b>\s*<br/>\s*Step:\s*(\d+)", page)
    beating = re.search(r"\[(\d+) heartbeating\]", page)
    if quorum is None:
        return "its status page did not name a quorum (not a torchft 0.2 lighthouse?)"
    parts = [f"quorum {quorum.group(1)}"]
    if members:
        groups = ", ".join(f"{name} at step {step}" for name, step in members)
        parts.append(f"{len(members)} replica group(s): {groups}")
    else:
        parts.append("no quorum formed yet")
    if beating is not None:
        parts.append(f"{beating.group(1)} heartbeating")
    return "; ".join(parts)
