"""A real MLflow tracking server on the loopback interface, started by the tests (SQLite store, local artifacts).

``start(root)`` runs ``mlflow server`` (the public CLI, as users start it) with a SQLite backend store and a local
artifact destination under ``root``, served through the server (clients upload artifacts over HTTP), and returns once
it answers. Robust on a busy machine:

* **Port**: a free port is picked by binding port 0; if something else takes it before the server binds, the server
  exits ("address already in use") or never logs that it runs on that port, and ``start`` retries with a new one.
  "Ready" means *our* server's log says it listens on the port and ``/health`` answers, so another server on the
  same port is never mistaken for ours.
* **Readiness**: polled until ``timeout`` (the server imports a lot: 5-80 s here); if it exits or times out the
  error carries its log.
* **Teardown**: the server runs in its own session under a small supervisor that kills the whole session when its
  stdin closes, which happens in :meth:`Server.stop` and also when the test process dies, so no server outlives the
  test run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Runs `mlflow server` in a new session and kills that session once stdin reaches EOF (or on SIGTERM).
_SUPERVISOR = r"""
import os, signal, subprocess, sys
server = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL)
stopping = False
def stop(*_):
    global stopping
    stopping = True
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
import threading
threading.Thread(target=lambda: (server.wait(), stopping or os._exit(3)), daemon=True).start()
sys.stdin.read()
stop()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    uri: str
    root: Path
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=15)


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start(root: Path, timeout: float = 240.0, attempts: int = 3) -> Server:
    root.mkdir(parents=True, exist_ok=True)
    errors = []
    for attempt in range(attempts):
        port = _free_port()
        log = root / f"server-{attempt}.log"
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-c", _SUPERVISOR, *command], stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, env=env, cwd=root,
            )  # fmt: skip
        server = Server(f"http://127.0.0.1:{port}", root, process, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            if f"running on http://127.0.0.1:{port}" in log.read_text(errors="replace") and _healthy(server.uri):
                return server
            time.sleep(0.25)
        server.stop()
        text = log.read_text(errors="replace")
        if "address already in use" in text.lower():
            errors.append(f"port {port} was taken")
            continue
        raise RuntimeError(
            f"The MLflow server did not become ready within {timeout:.0f} s (exit code {process.poll()}); its log:\n"
            + text[-4000:]
        )
    raise RuntimeError(f"Could not start the MLflow server: {'; '.join(errors)}")
