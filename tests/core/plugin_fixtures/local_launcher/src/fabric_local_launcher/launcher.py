"""``fabric run --launcher local_procs``: every process of the job on this machine, started by this command.

Options: ``--local-procs-address ADDRESS`` (where rank 0 listens, default 127.0.0.1) and
``--local-procs-grace SECONDS`` (how long the other processes get to end after a failure, default 5).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from fabric_core.environments import find_free_port
from fabric_core.launchers import (
    Launcher,
    job_exit_code,
    rank_failure,
    report_failures,
    start_rank_process,
    stop_processes,
)

OPTIONS = ("address", "grace")


class LocalProcessesLauncher(Launcher):
    runs_scripts = True
    requires_function = True

    def launch(self, function, *args, **kwargs):
        raise NotImplementedError("local_procs starts `fabric run` jobs only: use `fabric run --launcher local_procs`.")

    @classmethod
    def run_script(cls, request) -> int:
        unknown = sorted(set(request.options) - set(OPTIONS))
        if unknown:
            print(f"fabric run --launcher local_procs: error: unknown option(s) {unknown}", file=sys.stderr)
            return 2
        address = request.options.get("address", "127.0.0.1")
        grace = float(request.options.get("grace", 5))
        code = 1
        for attempt in range(request.max_restarts + 1):
            code = cls._attempt(request, address, grace, attempt)
            if code == 0:
                return 0
        return code

    @staticmethod
    def _attempt(request, address: str, grace: float, attempt: int) -> int:
        port = find_free_port()
        target = ["-m", request.script] if request.module else [request.script]
        processes, error_files = [], []
        with tempfile.TemporaryDirectory(prefix="local-procs-") as errors:
            for node in range(request.num_nodes):
                for local in range(request.processes_per_node):
                    error_file = os.path.join(errors, f"node{node}-local{local}.json")
                    env = {**os.environ, **request.process_environment(node, local, address, port, restart=attempt)}
                    command = [sys.executable, *target, *request.script_args]
                    processes.append(start_rank_process(command, env, error_file))
                    error_files.append(error_file)
            try:
                while True:
                    codes = [p.poll() for p in processes]
                    if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                        break
                    time.sleep(0.05)
            finally:
                stop_processes(processes, grace)  # the others, after a failure (or Ctrl-C): with what they started
            failures = [
                rank_failure(f"Rank {rank}", p, error_file)
                for rank, (p, error_file) in enumerate(zip(processes, error_files))
                if p.returncode != 0
            ]
        if not failures:
            return 0
        sys.stderr.write(report_failures(failures))
        return job_exit_code(failures)
