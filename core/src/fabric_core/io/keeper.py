"""The keeper: one small process per node that serves the memory tier's snapshots beyond the training processes.

Started by the first rank of a node that needs it (``python -m fabric_core.io.keeper``, detached in a session of its
own, so neither a crash of the training processes nor the launcher stopping them takes it down) and bound to the
launcher's lifetime: it serves while an *owner* (the launcher's process: ``fabric run``'s, torchrun's agent, Ray's
worker host; restarted training processes register again) lives, and lingers ``FABRIC_MEMORY_LINGER`` seconds
(default 600) after the last one ended, so that a requeued job on this node finds the snapshots; then it removes the
node's snapshots and exits. When every rank of the node said the training finished, it removes them at once.

What it does, each over a TCP connection that carries the node's token (``keeper.json``, readable by the user only):

* ``replicate``: send a committed snapshot of this node to a peer node's keeper (``store``), which writes it under a
  hidden name, checks its checksum and renames it into place (the commit rule); only the newest request per rank is
  kept, so a slow link skips snapshots instead of queuing them;
* ``fetch``: send a snapshot (own or a peer copy) to a restarted rank whose node lost it;
* ``write``: write a snapshot as a single-file checkpoint on disk or at a URL (the disk tier's asynchronous saves run
  here, outside the training process and its GIL; torch is imported for the first one only);
* ``status``, ``register``, ``finished``, ``ping``.

Messages are an 8-byte length and a JSON header, then the files' bytes the header announces. Only the standard
library is imported until the first ``write`` or the first peer copy received (its checksum is torch's
``hash_tensor``: :mod:`fabric_core.io.snapshot_checksum`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import secrets
import shutil
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric_core.io import snapshot_store as store
from fabric_core.utilities.exceptions import on_failure

INFO = "keeper.json"
LOCK = "keeper.lock"
LOG = "keeper.log"
LINGER_VARIABLE = "FABRIC_MEMORY_LINGER"
DEFAULT_LINGER_S = 600.0
_HEADER = struct.Struct("!Q")
_RECV_CHUNK = 8 << 20


class KeeperError(RuntimeError):
    """The keeper could not be started or reached, or refused a request (the message says why)."""


# ------------------------------------------------------------------------------------------------------ wire
def send_message(sock: socket.socket, header: dict[str, Any], files: list[tuple[Path, int]] = ()) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(raw)) + raw)
    for path, size in files:
        # socket.sendfile, not os.sendfile: a socket with a timeout is non-blocking underneath, and os.sendfile gives
        # EAGAIN as soon as the send buffer is full (a snapshot of more than a few MiB); socket.sendfile waits for room
        with open(path, "rb") as f:
            sent = sock.sendfile(f, 0, size)
        if sent != size:
            raise ConnectionError(f"{path} ended after {sent} of {size} bytes")


def recv_exact(sock: socket.socket, size: int) -> bytes:
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(out)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (length,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if length > 1 << 26:
        raise ConnectionError("header too large")
    return json.loads(recv_exact(sock, length))


def recv_into(sock: socket.socket, target: memoryview, what: str) -> None:
    """Fill ``target`` from the socket (``recv_into``: straight into its memory, no intermediate buffer)."""
    size, got = len(target), 0
    while got < size:
        n = sock.recv_into(target[got:], min(size - got, _RECV_CHUNK))
        if n == 0:
            raise ConnectionError(f"connection closed with {size - got} of {size} bytes of {what} to come")
        got += n


def recv_to_file(sock: socket.socket, path: Path, size: int) -> None:
    """Receive ``size`` bytes into the file ``path`` (new, or a kept data file renamed there), straight into its pages
    through a shared mapping, allocated first so that a full tmpfs fails here rather than with a SIGBUS; a reused file
    of this size has its pages already (allocating 512 MiB of tmpfs pages for every copy cost more than the copy)."""
    with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+b") as f:
        store.size_data_file(f.fileno(), size)
        if not size:
            return
        with mmap.mmap(f.fileno(), size) as mapped, memoryview(mapped) as target:
            recv_into(sock, target, path.name)


def receive_snapshot(sock: socket.socket, header: dict[str, Any], folder: Path, step: int) -> Path:
    """Receive the files ``header`` announces into a hidden folder under ``folder``, check the checksum against the
    manifest, and commit the snapshot (rename); returns its path. A transfer cut midway leaves only the hidden folder,
    removed here (or by the next writer if this process dies)."""
    from fabric_core.io import snapshot_checksum  # torch: imported by the first copy received

    sizes = header["files"]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / store.temp_name(step)
    tmp.mkdir()
    with on_failure(lambda: shutil.rmtree(tmp, ignore_errors=True)):
        skeleton = recv_exact(sock, sizes[store.SKELETON])
        (tmp / store.SKELETON).write_bytes(skeleton)
        reused = store.claim_free(folder)  # the data file of a pruned copy
        if reused is not None:
            os.rename(reused, tmp / store.DATA)
        recv_to_file(sock, tmp / store.DATA, sizes[store.DATA])
        manifest_bytes = recv_exact(sock, sizes[store.MANIFEST])
        manifest = json.loads(manifest_bytes)
        if manifest.get("data_bytes") != sizes[store.DATA]:
            raise store.SnapshotChecksumError(f"a copy of step {step} announces {sizes[store.DATA]} data bytes, its manifest {manifest.get('data_bytes')}")
        found = snapshot_checksum.checksum_file(tmp / store.DATA, sizes[store.DATA], skeleton)
        if found != manifest.get("checksum"):
            raise store.SnapshotChecksumError(f"the copy of step {step} arrived with checksum {found}, not {manifest.get('checksum')}")
        (tmp / store.MANIFEST).write_bytes(manifest_bytes)
        target = folder / store.snapshot_name(step)
        store.commit(tmp, target)
        return target


def send_snapshot(sock: socket.socket, header: dict[str, Any], snapshot: Path) -> None:
    """Send a committed snapshot (read-locked meanwhile, so pruning leaves it alone) after ``header``."""
    with store.ReadLock(snapshot / store.DATA):
        manifest = store.read_manifest(snapshot)
        files = [
            (snapshot / store.SKELETON, (snapshot / store.SKELETON).stat().st_size),
            (snapshot / store.DATA, manifest["data_bytes"]),
            (snapshot / store.MANIFEST, (snapshot / store.MANIFEST).stat().st_size),
        ]
        send_message(sock, {**header, "files": {path.name: size for path, size in files}}, files)


# ------------------------------------------------------------------------------------------------------ client
class KeeperClient:
    """A connection's worth of requests to a keeper at ``(host, port)`` with its ``token``."""

    def __init__(self, host: str, port: int, token: str, timeout: float | None = 60.0) -> None:
        self.address = (host, port)
        self.token = token
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, op: str, *, wait: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and wait for the reply (``wait`` seconds at most, default the client's timeout; a disk write,
        whose first one imports torch in the keeper, is given longer)."""
        with self._connect() as sock:
            send_message(sock, {"op": op, "token": self.token, **fields})
            if wait is not None:
                sock.settimeout(wait)
            reply = recv_message(sock)
        if not reply.get("ok"):
            raise KeeperError(f"the keeper at {self.address[0]}:{self.address[1]} refused {op!r}: {reply.get('error')}")
        return reply

    def fetch(self, key: str, step: int, allocate: Callable[[int], Any]) -> tuple[dict[str, Any], bytes, Any]:
        """The keeper's snapshot of ``key`` at ``step`` (its own or a peer copy), received straight into this process's
        memory (``allocate(size)`` gives a writable buffer): ``(manifest, skeleton bytes, data)``. Not checked here:
        the caller checks the checksum (:func:`fabric_core.io.memory.state_from_parts`)."""
        with self._connect() as sock:
            send_message(sock, {"op": "fetch", "token": self.token, "key": key, "step": step})
            reply = recv_message(sock)
            if not reply.get("ok"):
                raise KeeperError(f"the keeper at {self.address[0]}:{self.address[1]} has no snapshot of {key} at step {step}: {reply.get('error')}")
            sizes = reply["files"]
            skeleton = recv_exact(sock, sizes[store.SKELETON])
            data = allocate(sizes[store.DATA])
            with memoryview(data) as target:
                recv_into(sock, target, f"the snapshot of {key} at step {step}")
            manifest = json.loads(recv_exact(sock, sizes[store.MANIFEST]))
        return manifest, skeleton, data


def read_info(root: Path) -> dict[str, Any] | None:
    try:
        with open(root / INFO, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def local_client(root: Path) -> KeeperClient | None:
    """A client of this node's live keeper, or ``None`` when none answers."""
    info = read_info(root)
    if info is None or not _pid_alive(int(info.get("pid", 0))):
        return None
    client = KeeperClient("127.0.0.1", int(info["port"]), info["token"], timeout=10.0)
    try:
        client.request("ping")
    except (OSError, KeeperError, ValueError):
        return None
    return client


def ensure_keeper(root: Path, owner: int, timeout: float = 60.0) -> tuple[KeeperClient, int]:
    """This node's keeper for ``root`` (started when none answers), registered with ``owner`` as a process it serves;
    returns its client and pid. Ranks of one node starting together start one keeper (a lock file orders them). A
    keeper that is stopping (every rank of the node said it finished) answers no more: a new one is started."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    deadline = time.monotonic() + timeout
    while True:
        client = _running_or_started(root, owner, deadline, timeout)
        try:
            client.request("register", owner=owner)
        except (OSError, KeeperError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # it stopped between the ping and the registration: start another
            continue
        info = read_info(root) or {}
        return client, int(info.get("pid", 0))


def _running_or_started(root: Path, owner: int, deadline: float, timeout: float) -> KeeperClient:
    client = local_client(root)
    if client is not None:
        return client
    import fcntl

    with open(root / ".keeper-start.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        client = local_client(root)
        if client is None:
            _start(root, owner)
            while client is None and time.monotonic() < deadline:
                time.sleep(0.05)
                client = local_client(root)
            if client is None:
                log = (root / LOG).read_text(errors="replace")[-2000:] if (root / LOG).exists() else ""
                raise KeeperError(f"The memory tier's keeper for {root} did not start within {timeout:.0f} s.\n{log}")
    return client


def _start(root: Path, owner: int) -> None:
    log = open(root / LOG, "ab")  # noqa: SIM115 - handed to the child
    try:
        subprocess.Popen(
            [sys.executable, "-m", "fabric_core.io.keeper", "--root", str(root), "--owner", str(owner)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # not in the launcher's process group: stopping the workers leaves it
            close_fds=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        log.close()


# ------------------------------------------------------------------------------------------------------ server
class Keeper:
    """The keeper's state; one per node and run folder (``keeper.lock`` held while it lives)."""

    def __init__(self, root: Path, owner: int, linger: float) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.owners: set[int] = {owner}
        self.linger = linger
        self.finished: set[str] = set()
        self.expected_ranks: int | None = None
        self.replicated: dict[str, int] = {}
        self.errors: list[str] = []
        self._replicas: dict[str, dict[str, Any]] = {}
        self._replica_ready = threading.Condition()
        self._lock = threading.Lock()
        self.stop = threading.Event()
        #: every rank finished: no more requests are served; ``stop`` follows once the reply is sent
        self.stopping = False
        self.remove_on_exit = False

    # ---------------------------------------------------------------------------------- requests
    def handle(self, sock: socket.socket) -> None:
        header = recv_message(sock)
        if not secrets.compare_digest(str(header.get("token", "")), self.token):
            send_message(sock, {"ok": False, "error": "wrong token"})
            return
        op = header.get("op")
        if self.stopping or self.stop.is_set():  # its snapshots are going; whoever asks starts a new keeper
            send_message(sock, {"ok": False, "error": "the keeper is stopping"})
            return
        try:
            reply = getattr(self, f"op_{op}")(sock, header)
        except Exception as err:  # the requester gets the reason; the keeper goes on
            self._note(f"{op}: {type(err).__name__}: {err}")
            with contextlib.suppress(OSError):
                send_message(sock, {"ok": False, "error": f"{type(err).__name__}: {err}"})
            return
        if reply is not None:
            send_message(sock, {"ok": True, **reply})
        if self.stopping:
            self.stop.set()  # only after the reply: the process exits when its main thread sees this

    def _note(self, message: str) -> None:
        with self._lock:
            self.errors = (self.errors + [message])[-20:]
        print(f"[fabric keeper {os.getpid()}] {message}", file=sys.stderr, flush=True)

    def op_ping(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid(), "root": str(self.root)}

    def op_register(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.owners.add(int(header["owner"]))
            if header.get("ranks"):
                self.expected_ranks = int(header["ranks"])
            self.finished.discard(str(header.get("key")))
        return {}

    def op_finished(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.finished.add(str(header["key"]))
            self.expected_ranks = int(header.get("ranks") or self.expected_ranks or 1)
            done = len(self.finished) >= self.expected_ranks
        if done:  # every rank of the node finished training: the snapshots are no longer needed
            self.remove_on_exit = True
            self.stopping = True  # first: from now on it answers no request (a new run's ranks start a new keeper)
            self.forget_info()
            self.release_snapshots()  # before the reply: when the last rank's `close()` returns, the memory is free
        return {}

    def forget_info(self) -> None:
        """Remove ``keeper.json`` if it still names this process (a keeper started after it may have replaced it)."""
        info = read_info(self.root)
        if info is not None and int(info.get("pid", 0)) == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(self.root / INFO)

    def release_snapshots(self) -> None:
        """Remove this node's snapshots, its own and its peers'."""
        for name in (store.OWN, store.PEER):
            shutil.rmtree(self.root / name, ignore_errors=True)

    def op_status(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {"replicated": dict(self.replicated), "errors": list(self.errors), "pending": len(self._replicas)}

    def op_replicate(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        with self._replica_ready:
            self._replicas[header["key"]] = header  # only the newest snapshot of a rank is worth sending
            self._replica_ready.notify()
        return {"queued": True}

    def op_store(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        folder = store.rank_folder(self.root, store.PEER, header["key"])
        receive_snapshot(sock, header, folder, int(header["step"]))
        store.prune(folder, int(header.get("keep_last", 2)))  # the pruned copy's data file is the next one's
        return {}

    def op_fetch(self, sock: socket.socket, header: dict[str, Any]) -> None:
        key, step = header["key"], int(header["step"])
        for kind in (store.OWN, store.PEER):
            snapshot = store.rank_folder(self.root, kind, key) / store.snapshot_name(step)
            if snapshot.is_dir():
                send_snapshot(sock, {"ok": True, "kind": kind}, snapshot)
                return None
        send_message(sock, {"ok": False, "error": f"no snapshot of {key} at step {step} on this node"})
        return None

    def op_write(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        from fabric_core.io.memory import write_file  # torch: imported by the first disk write only

        snapshot = Path(header["snapshot"])
        started = time.perf_counter()
        with store.ReadLock(snapshot / store.DATA):
            write_file(snapshot, header["target"], header.get("storage_options"))
        return {"seconds": time.perf_counter() - started}

    # ---------------------------------------------------------------------------------- background work
    def replicate_forever(self) -> None:
        while not self.stop.is_set():
            with self._replica_ready:
                while not self._replicas and not self.stop.is_set():
                    self._replica_ready.wait(0.5)
                if self.stop.is_set():
                    return
                key = next(iter(self._replicas))
                request = self._replicas.pop(key)
            try:
                self._replicate(request)
            except Exception as err:  # a failed copy (a peer gone, a disk full, ...) is noted; the keeper goes on
                self._note(f"replicating {key} step {request.get('step')} to {request.get('host')}:{request.get('port')} failed: {type(err).__name__}: {err}")

    def _replicate(self, request: dict[str, Any]) -> None:
        snapshot = Path(request["path"])
        if not snapshot.is_dir():
            return  # pruned meanwhile: a newer one follows
        with socket.create_connection((request["host"], int(request["port"])), timeout=120) as sock:
            header = {"op": "store", "token": request["peer_token"], "key": request["key"], "step": request["step"],
                      "keep_last": request.get("keep_last", 2)}  # fmt: skip
            send_snapshot(sock, header, snapshot)
            reply = recv_message(sock)
        if not reply.get("ok"):
            raise KeeperError(reply.get("error"))
        with self._lock:
            self.replicated[request["key"]] = max(int(request["step"]), self.replicated.get(request["key"], -1))

    def watch_owners(self) -> None:
        """Serve while an owner lives; linger, then remove the node's snapshots and stop."""
        alone_since: float | None = None
        while not self.stop.wait(0.5):
            with self._lock:
                self.owners = {pid for pid in self.owners if _pid_alive(pid)}
                alive = bool(self.owners)
            if alive:
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if time.monotonic() - alone_since >= self.linger:
                self.remove_on_exit = True
                self.stop.set()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.server.keeper.handle(self.request)  # type: ignore[attr-defined]
        except (ConnectionError, OSError, ValueError) as err:
            self.server.keeper._note(f"a request failed: {type(err).__name__}: {err}")  # type: ignore[attr-defined]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(root: Path, owner: int, linger: float) -> int:
    import fcntl

    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(root / LOCK, "w")  # noqa: SIM115 - held for the process's life
    deadline = time.monotonic() + 30.0  # a keeper that is stopping holds the lock until it has exited
    while True:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"[fabric keeper] another keeper serves {root}", file=sys.stderr)
                return 0
            time.sleep(0.05)
    keeper = Keeper(root, owner, linger)
    server = _Server((os.environ.get("FABRIC_KEEPER_BIND", "0.0.0.0"), 0), _Handler)
    server.keeper = keeper  # type: ignore[attr-defined]
    info = {"pid": os.getpid(), "port": server.server_address[1], "token": keeper.token, "started_unix": time.time()}
    tmp = root / f".{INFO}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, root / INFO)
    threads = [
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True),
        threading.Thread(target=keeper.replicate_forever, daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        keeper.watch_owners()
    finally:
        server.shutdown()
        server.server_close()
        if keeper.remove_on_exit:  # again: a replica may have landed after the release
            keeper.release_snapshots()
            keeper.forget_info()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_core.io.keeper", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--owner", required=True, type=int)
    parser.add_argument("--linger", type=float, default=float(os.environ.get(LINGER_VARIABLE, DEFAULT_LINGER_S)))
    args = parser.parse_args(argv)
    return serve(args.root, args.owner, args.linger)


if __name__ == "__main__":
    sys.exit(main())
