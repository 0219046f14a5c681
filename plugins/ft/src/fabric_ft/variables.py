"""The environment variables of a replica group, in one place (the strategy reads them, the launcher sets them)."""

from __future__ import annotations

#: torchft's own variable for the lighthouse address (``http://host:port``), also read by its Manager.
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
#: Which replica group this process belongs to, and how many there are (the names torchft's examples use).
REPLICA_GROUP_VARIABLE = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_VARIABLE = "NUM_REPLICA_GROUPS"
#: The address the other groups reach this one at, when ``hostname=`` is not given (``fabric run --launcher ft`` sets
#: it to 127.0.0.1: every group on one machine).
HOSTNAME_VARIABLE = "FABRIC_FT_HOSTNAME"

__all__ = ["HOSTNAME_VARIABLE", "LIGHTHOUSE_VARIABLE", "NUM_REPLICA_GROUPS_VARIABLE", "REPLICA_GROUP_VARIABLE"]
