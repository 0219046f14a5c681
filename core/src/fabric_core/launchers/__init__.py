"""Launchers: how the processes of a multi-process run are started and stopped, and how a failed rank is reported.

Part of the plugin SDK: the names in ``__all__`` are the stable contract plugins (ours and third parties') import,
listed in docs/plugins.md; every other module of the core is internal and may change. The names are imported on
first access, so importing this package costs nothing.
"""

from __future__ import annotations

from fabric_core.utilities.lazy import lazy_exports

__all__ = [
    "ERROR_FILE_VARIABLE",
    "Launcher",
    "RankFailure",
    "RecordedError",
    "ScriptRequest",
    "die_with_parent",
    "exit_status",
    "job_exit_code",
    "new_process_group",
    "parent_death_signal",
    "rank_failure",
    "read_error_file",
    "report_failures",
    "signal_process_group",
    "start_rank_process",
    "stop_processes",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    "fabric-core",
    {
        "Launcher": "fabric_core.launchers.base",
        "ScriptRequest": "fabric_core.launchers.base",
        "die_with_parent": "fabric_core.launchers.processes",
        "exit_status": "fabric_core.launchers.processes",
        "new_process_group": "fabric_core.launchers.processes",
        "parent_death_signal": "fabric_core.launchers.processes",
        "signal_process_group": "fabric_core.launchers.processes",
        "start_rank_process": "fabric_core.launchers.processes",
        "rank_failure": "fabric_core.launchers.processes",
        "stop_processes": "fabric_core.launchers.processes",
        "ERROR_FILE_VARIABLE": "fabric_core.runtime.failures",
        "RankFailure": "fabric_core.runtime.failures",
        "RecordedError": "fabric_core.runtime.failures",
        "job_exit_code": "fabric_core.runtime.failures",
        "read_error_file": "fabric_core.runtime.failures",
        "report_failures": "fabric_core.runtime.failures",
    },
)
