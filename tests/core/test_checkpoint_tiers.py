"""Checkpoint tiers in one process (a real keeper process beside it): what a snapshot holds, the commit rule and the
checksums (a corrupted snapshot falls back to the one before, a torn one is never seen, a copy cut midway never
commits), the shared-memory limits, rollback on a non-finite loss, the overlapped copy's guard, and the preemption
deadline. The multi-node scenarios (peer copies, a lost node, SIGTERM under ``fabric run``) are in
``tests/plugins/ddp/test_tiers_across_nodes.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.io import keeper, snapshot_checksum
from fabric_core.io import snapshot_store as store
from fabric_core.io.memory import MemoryTierError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="shared memory in /dev/shm, flock, sendfile")


@pytest.fixture
def memory_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = Path("/dev/shm") / f"fabric-test-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv(store.MEMORY_DIR_VARIABLE, str(folder))
    monkeypatch.setenv(keeper.LINGER_VARIABLE, "60")
    yield folder
    _end_keeper(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _end_keeper(folder: Path) -> None:
    info = keeper.read_info(folder)
    if info:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(info["pid"]), signal.SIGKILL)


def _setup(tmp_path: Path, **options):
    fabric = Fabric(accelerator="cpu", devices=1, run_dir=tmp_path / "run")
    fabric.seed_everything(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    options.setdefault("preemption", False)
    tiers = fabric.checkpoint_tiers(**options)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    return fabric, model, optimizer, tiers, state


def _train(fabric, model, optimizer, tiers, state, steps: int, data: list | None = None) -> list[dict]:
    """``steps`` optimizer steps with a snapshot after each; returns the weights after every step."""
    seen = []
    for _ in range(steps):
        x = data[state["step"]] if data is not None else torch.randn(6, 4)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        state["step"] += 1
        tiers.save(state["step"], state)
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    tiers.wait()
    return seen


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_snapshots_keep_the_newest_steps_and_the_keeper_writes_the_disk_tier(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_keep_last=2, disk_every=2)
    seen = _train(fabric, model, optimizer, tiers, state, 5)
    assert tiers.keeper_pid and tiers.keeper_pid != os.getpid()
    folder = memory_dir / "own" / "single"
    assert [step for step, _ in store.committed(folder)] == [4, 5]  # keep_last=2 (the step-4 one was on disk too)
    manifest = snapshot_checksum.verify(folder / "step-000000005")
    assert manifest["key"] == "single" and manifest["layout"] == {"world_size": 1, "axes": []}
    disk = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*.ckpt"))
    assert disk == ["step-000000002.ckpt", "step-000000004.ckpt"]
    on_disk = torch.load(tmp_path / "run" / "checkpoints" / "step-000000004.ckpt", weights_only=True)
    assert on_disk["step"] == 4 and _same(on_disk["model"], seen[3])
    assert set(on_disk["optimizer"]["state"]) == {0, 1, 2, 3}

    assert fabric.latest_checkpoint(tiers) == "mem://step-000000005"
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    state["step"] = 0
    fabric.load("mem://step-000000005", state)
    assert state["step"] == 5 and _same(model.state_dict(), seen[4])
    assert tiers.recovery["tier"] == "memory" and tiers.recovery["source"] == "own memory of node 0"
    tiers.close()
    assert keeper.local_client(memory_dir) is None or not (memory_dir / "own").exists()


def test_waiting_for_one_tiers_handle_alone_returns_once_the_file_is_written(tmp_path: Path, memory_dir: Path):
    """The disk file of a step is written by the keeper from that step's memory snapshot, whose last copies overlap
    the next step: waiting on the disk handle alone (not `TierSave.wait()`) completes the snapshot first instead of
    waiting for a step that the waiting caller will never take."""
    import threading

    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, disk_every=1)
    loss = model(torch.randn(6, 4)).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    saved = tiers.save(1, state)
    waiter = threading.Thread(target=saved.handles["disk"].wait, daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), "the disk handle's wait() did not return"
    on_disk = torch.load(tmp_path / "run" / "checkpoints" / "step-000000001.ckpt", weights_only=True)
    assert on_disk["step"] == 0 and _same(on_disk["model"], model.state_dict())
    tiers.close()


def test_a_corrupted_snapshot_is_skipped_for_the_one_before_and_a_torn_one_is_never_seen(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_keep_last=3, disk=None)
    seen = _train(fabric, model, optimizer, tiers, state, 4)
    folder = memory_dir / "own" / "single"
    # a snapshot torn mid-write (its writer died before the rename) at a later step: hidden, never listed
    torn = folder / ".step-000000009.tmp-somehost-999999-abc"
    shutil.copytree(folder / "step-000000004", torn)
    # a bit flipped in the newest snapshot's data
    data = folder / "step-000000004" / store.DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))

    latest = fabric.latest_checkpoint(tiers)
    assert latest == "mem://step-000000004"
    with pytest.warns(RuntimeWarning, match=r"Could not restore the memory snapshot of step 4 \(rank 0: SnapshotChecksumError: .*checksum xor64b64k\+crc32:\w+ does not match.*falling back to the memory snapshot of step 3"):
        fabric.load(latest, state)
    assert state["step"] == 3 and _same(model.state_dict(), seen[2])
    assert tiers.recovery["step"] == 3 and len(tiers.recovery["fallbacks"]) == 1
    record = json.loads((tmp_path / "run" / "checkpoints" / "recovery" / "attempt-0.json").read_text())
    assert record[-1]["event"] == "resumed" and record[-1]["step"] == 3
    tiers.close()


def test_every_tier_failing_is_an_error_naming_each(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_keep_last=1, disk=None)
    _train(fabric, model, optimizer, tiers, state, 1)
    (memory_dir / "own" / "single" / "step-000000001" / store.SKELETON).write_bytes(b"garbage")
    latest = fabric.latest_checkpoint(tiers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="No checkpoint of any tier could be restored: the memory snapshot of step 1"):
            fabric.load(latest, state)
    tiers.close()


def test_a_copy_cut_midway_or_with_a_wrong_checksum_never_commits(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, disk=None)
    _train(fabric, model, optimizer, tiers, state, 1)
    snapshot = memory_dir / "own" / "single" / "step-000000001"
    client = keeper.local_client(memory_dir)
    sizes = {name: (snapshot / name).stat().st_size for name in (store.SKELETON, store.DATA, store.MANIFEST)}
    header = {"op": "store", "token": client.token, "key": "data_replicate-9", "step": 1, "files": sizes}

    with socket.create_connection(client.address) as sock:  # a sender that dies halfway through the data
        keeper.send_message(sock, header)
        sock.sendall((snapshot / store.SKELETON).read_bytes())
        sock.sendall((snapshot / store.DATA).read_bytes()[: sizes[store.DATA] // 2])
    manifest = json.loads((snapshot / store.MANIFEST).read_text())
    manifest["checksum"] = f"{snapshot_checksum.KIND}:00000000"
    with socket.create_connection(client.address) as sock:  # a copy whose bytes do not match its checksum
        bad = json.dumps(manifest).encode()
        keeper.send_message(sock, {**header, "step": 2, "files": {**sizes, store.MANIFEST: len(bad)}})
        sock.sendall((snapshot / store.SKELETON).read_bytes() + (snapshot / store.DATA).read_bytes() + bad)
        reply = keeper.recv_message(sock)
    assert not reply["ok"] and "arrived with checksum" in reply["error"]
    peer = memory_dir / "peer" / "data_replicate-9"

    def cut_reported() -> bool:  # each connection has its own thread in the keeper: the cut one may report later
        return any("connection closed" in error for error in client.request("status")["errors"])

    deadline = time.monotonic() + 30
    while not cut_reported() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cut_reported(), client.request("status")
    while any(peer.iterdir()) and time.monotonic() < deadline:  # then neither copy's temporary files remain
        time.sleep(0.05)
    assert list(peer.iterdir()) == [] and store.committed(peer) == []
    tiers.close()


def test_too_little_shared_memory_is_a_clear_error_and_the_disk_tier_goes_on(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_limit=1000, disk_every=1)
    with pytest.warns(RuntimeWarning) as caught:
        _train(fabric, model, optimizer, tiers, state, 2)
    message = str(caught[0].message)
    assert "The memory tier needs" in message and "memory_limit leaves 1000 B" in message
    assert "--shm-size" in message and store.MEMORY_DIR_VARIABLE in message and "other checkpoint tiers" in message
    assert isinstance(tiers.memory_error, MemoryTierError) and not tiers.memory_on
    assert not (memory_dir / "own").exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-000000001.ckpt", "step-000000002.ckpt"]
    assert fabric.latest_checkpoint(tiers).endswith("step-000000002.ckpt")
    tiers.close()


def test_a_small_tmpfs_is_found_too_small_before_the_first_snapshot(tmp_path: Path, memory_dir: Path, monkeypatch):
    mount = tmp_path / "small-shm"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (the memory_limit test covers the same check)")
    try:
        monkeypatch.setenv(store.MEMORY_DIR_VARIABLE, str(mount / "node"))
        fabric = Fabric(accelerator="cpu", devices=1, run_dir=tmp_path / "run")
        model = fabric.setup(nn.Linear(128, 128))  # 66 KiB of state: 3 snapshots do not fit in 64 KiB
        tiers = fabric.checkpoint_tiers(memory_every=1, disk_every=1, preemption=False)
        with pytest.warns(RuntimeWarning, match=r"needs 193\.5 KiB of shared memory on node 0 .* \(a filesystem of 64\.0 KiB"):
            tiers.save(1, {"model": model})
        tiers.wait()
        assert (tmp_path / "run" / "checkpoints" / "step-000000001.ckpt").is_file()
        tiers.close()
    finally:
        _end_keeper(mount / "node")
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_non_finite_loss_rolls_back_and_skips_the_batch(tmp_path: Path, memory_dir: Path):
    torch.manual_seed(0)
    data = [torch.randn(6, 4) for _ in range(8)]
    poisoned = [x.clone() for x in data]
    poisoned[4][0, 0] = float("nan")

    def run(batches, rollback: bool):
        fabric, model, optimizer, tiers, state = _setup(tmp_path / f"run-{rollback}", memory_every=1, disk=None)
        skipped = []
        for index, x in enumerate(batches):
            loss = model(x).pow(2).mean()
            if rollback and tiers.rollback_if_not_finite(loss, state):
                skipped.append(index)
                continue
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            tiers.save(state["step"], state)
        tiers.close()
        return model.state_dict(), state["step"], skipped

    expected, steps, _ = run(data[:4] + data[5:], rollback=False)  # the uninterrupted run without batch 4
    with pytest.warns(RuntimeWarning, match="rolled back to the memory snapshot of step 4 and skipped the batch"):
        weights, rolled_steps, skipped = run(poisoned, rollback=True)
    assert skipped == [4] and rolled_steps == steps == 7
    assert _same(weights, expected)


def test_weights_already_broken_walk_back_through_the_kept_snapshots(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_keep_last=3, disk=None)
    seen = _train(fabric, model, optimizer, tiers, state, 3)
    with torch.no_grad():  # step 3's update broke the weights, and its snapshot holds them
        next(model.parameters())[0, 0] = float("nan")
    tiers.save(3, state)
    tiers.wait()
    x = torch.randn(6, 4)
    with pytest.warns(RuntimeWarning, match="step 3"):
        assert tiers.rollback_if_not_finite(model(x).pow(2).mean(), state)
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert tiers.rollback_if_not_finite(model(x).pow(2).mean(), state)
    assert state["step"] == 2 and _same(model.state_dict(), seen[1])
    assert not tiers.rollback_if_not_finite(model(x).pow(2).mean(), state)
    tiers.close()


def test_a_parameter_changed_in_place_while_its_copy_overlaps_drops_that_snapshot(tmp_path: Path, memory_dir: Path):
    fabric, model, optimizer, tiers, state = _setup(tmp_path, memory_every=1, memory_keep_last=3, disk=None)
    _train(fabric, model, optimizer, tiers, state, 2)
    loss = model(torch.randn(6, 4)).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    state["step"] = 3
    tiers.save(3, state)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # outside optimizer.step(), before the snapshot's copy was checked
    with pytest.warns(RuntimeWarning, match=r"memory snapshot of step 3 was dropped: parameter '0\.weight' of 'model' changed in place"):
        tiers.wait()
    assert [step for step, _ in store.committed(memory_dir / "own" / "single")] == [1, 2]
    tiers.save(4, state)  # the next one is taken as usual
    tiers.wait()
    assert store.committed(memory_dir / "own" / "single")[-1][0] == 4
    tiers.close()


def test_a_preemption_notice_that_is_not_answered_in_time_exits_for_a_requeue_anyway():
    code = (
        "import os, signal, time\n"
        "from fabric_core.runtime.preemption import PreemptionNotice\n"
        "notice = PreemptionNotice(grace_period=0.3).install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.05)\n"
        "assert notice.requested and notice.received.name == 'SIGUSR1'\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert "SIGUSR1 arrived 0.3 s ago and the save for it has not finished: exiting for a requeue now" in done.stderr


def test_memory_locations_need_the_tiers(tmp_path: Path):
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"'mem://step-000000001' is a memory snapshot of the checkpoint tiers: create them first"):
        fabric.load("mem://step-000000001", {})


def test_new_tiers_right_after_every_rank_finished_get_a_keeper_of_their_own(tmp_path: Path, memory_dir: Path):
    # the keeper told that every rank finished is stopping while the next tiers look for it: they must not register
    # with it (it would refuse, or vanish with their snapshots) but start the next one
    pids = []
    previous = None
    for cycle in range(3):
        fabric = Fabric(accelerator="cpu", devices=1, run_dir=tmp_path / f"run-{cycle}")
        model = fabric.setup(nn.Linear(4, 1))
        if previous is not None:
            previous.close()  # the next tiers ask for a keeper at once
        tiers = fabric.checkpoint_tiers(memory_every=1, disk=None, preemption=False)
        state = {"model": model, "step": 0}
        tiers.save(1, state)
        tiers.wait()
        pids.append(tiers.keeper_pid)
        time.sleep(0.6)  # longer than the previous keeper takes to exit
        serving = keeper.local_client(memory_dir)
        assert serving is not None and serving.request("ping")["pid"] == tiers.keeper_pid, f"cycle {cycle}"
        assert store.committed(memory_dir / "own" / "single"), f"cycle {cycle}: no snapshot kept"
        previous = tiers
    previous.close()
    assert len(set(pids)) == 3, pids


def test_a_stopping_keeper_answers_nothing_and_a_registration_it_refused_starts_another(memory_dir: Path, monkeypatch):
    first, pid = keeper.ensure_keeper(memory_dir, os.getpid())
    first.request("finished", key="single", ranks=1)
    with pytest.raises((keeper.KeeperError, OSError)):  # "the keeper is stopping", or already gone
        first.request("ping")
    assert keeper.local_client(memory_dir) is None or keeper.local_client(memory_dir).request("ping")["pid"] != pid
    # the window the stop closes: a keeper that answered the ping and is gone at the registration
    refused = []
    real = keeper.KeeperClient.request

    def request(self, op, **fields):
        if op == "register" and not refused:
            refused.append(op)
            raise ConnectionRefusedError(111, "Connection refused")
        return real(self, op, **fields)

    monkeypatch.setattr(keeper.KeeperClient, "request", request)
    client, second = keeper.ensure_keeper(memory_dir, os.getpid())
    assert refused == ["register"] and second not in (0, pid)
    assert client.request("ping")["pid"] == second


def test_a_data_file_gets_its_pages_once_and_a_reused_one_is_not_asked_again(memory_dir: Path, monkeypatch):
    memory_dir.mkdir(parents=True)
    asked: list[int] = []
    allocate = os.posix_fallocate

    def counting(fd: int, offset: int, size: int) -> None:
        asked.append(size)
        allocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", counting)
    with open(memory_dir / "data", "w+b") as f:
        store.size_data_file(f.fileno(), 1 << 20)
        store.size_data_file(f.fileno(), 1 << 20)  # a reused file of the same size: its pages exist
        store.size_data_file(f.fileno(), 2 << 20)
        assert asked == [1 << 20, 2 << 20]
        assert os.fstat(f.fileno()).st_size == 2 << 20
        with pytest.raises(store.SnapshotChecksumError, match=f"holds {2 << 20} bytes, the manifest says {3 << 20}"):
            store.check_data_size(f.fileno(), 3 << 20, memory_dir / "data")

    def refusing(code: int):
        def fallocate(fd: int, offset: int, size: int) -> None:
            raise OSError(code, os.strerror(code))

        return fallocate

    with open(memory_dir / "other", "w+b") as f:
        monkeypatch.setattr(os, "posix_fallocate", refusing(errno.EOPNOTSUPP))
        store.size_data_file(f.fileno(), 4096)  # a filesystem without fallocate: left to the writes
        monkeypatch.setattr(os, "posix_fallocate", refusing(errno.ENOSPC))
        with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)):
            store.size_data_file(f.fileno(), 8192)


def _present_pages(start: int, length: int) -> int:
    """Pages of this process's memory in ``[start, start + length)`` that are backed now (/proc/self/pagemap, bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, count = start // page, -(-(start + length) // page) - start // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read(count * 8)
    return sum(1 for i in range(count) if int.from_bytes(raw[8 * i : 8 * i + 8], "little") >> 63)


def test_a_restore_from_memory_keeps_only_the_bytes_the_optimizer_holds(tmp_path: Path, memory_dir: Path):
    fabric = Fabric(accelerator="cpu", devices=1, run_dir=tmp_path / "run")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    model(torch.randn(4, 1024)).pow(2).mean().backward()
    optimizer.step()
    tiers = fabric.checkpoint_tiers(memory_every=1, disk=None, preemption=False)
    tiers.save(1, state)
    tiers.wait()
    saved_states = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()

    fabric.load(fabric.latest_checkpoint(tiers), state)

    manifest = store.read_manifest(store.committed(store.rank_folder(tiers.root, store.OWN, tiers.key))[-1][1])
    held = [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
    bases = None  # the restored buffer's address: the one every optimizer state is at an entry's offset of
    for tensor in held:
        here = {tensor.data_ptr() - e["offset"] for e in manifest["tensors"] if e["nbytes"] == tensor.nbytes}
        bases = here if bases is None else bases & here
    assert bases is not None and len(bases) == 1
    page = os.sysconf("SC_PAGE_SIZE")
    present = _present_pages(bases.pop(), manifest["data_bytes"]) * page
    states_bytes = sum(t.nbytes for t in held)
    assert manifest["data_bytes"] > states_bytes + 8 * 2**20  # the model's 8 MiB are in the snapshot too
    assert states_bytes <= present <= states_bytes + 64 * page  # ... but only the optimizer's bytes stay
    assert _same(model.state_dict(), saved_weights)
    for restored, saved in zip(optimizer.state.values(), saved_states):
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
    model(torch.randn(4, 1024)).pow(2).mean().backward()
    optimizer.step()  # the optimizer goes on with the bytes it kept
    tiers.close()
