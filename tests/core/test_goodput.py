"""The goodput ledger, its report and the checkpoint-interval suggestion, the straggler analysis, the chaos schedule
and the injected full disk: one process here (tests/plugins/ddp/test_goodput_jobs.py runs the multi-process ones)."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric_core import Fabric
from fabric_core.io import commit
from fabric_core.runtime import chaos, goodput, goodput_report, hang, run
from fabric_core.runtime.stragglers import PERSISTENCE, StragglerWatch
from fabric_core.testing.chaos import make_schedule, schedule_json


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in (run.RUN_ID_VARIABLE, run.RUN_DIR_VARIABLE, run.JOB_ID_VARIABLE, hang.HANG_TIMEOUT_VARIABLE, chaos.CHAOS_VARIABLE, *run.RESTART_COUNTS, *run.SCHEDULER_JOB_IDS):
        monkeypatch.delenv(name, raising=False)
    yield
    goodput.stop()
    hang.stop_watchdog()


def _train(fabric: Fabric, steps: int, start: int = 0, folder: Path | None = None, save_every: int = 0):
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer, "step": start}
    for step in range(start, steps):
        fabric.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if save_every and (step + 1) % save_every == 0:
            fabric.save(folder / f"step-{step + 1:03d}.ckpt", state)
    return model, optimizer, state


def test_one_process_ledger_record_summary_and_command(tmp_path, capsys):
    folder = tmp_path / "run"
    fabric = Fabric(accelerator="cpu", run_dir=folder)
    model, optimizer, state = _train(fabric, 6, folder=tmp_path / "ckpts", save_every=3)
    with fabric.section("evaluation"):
        model(torch.ones(2, 4))
    ledger = goodput.current()
    assert ledger is not None and ledger.write and ledger.global_step == 6 and ledger.steps == 6
    assert [step for _, step in ledger.saves] == [3, 6]
    ledger.ended = True
    ledger.flush()
    record = json.loads((folder / "goodput" / "attempt-000" / "rank-00000.json").read_text())
    seconds = record["seconds"]
    assert seconds["startup"] > 0 and seconds["productive"] > 0 and seconds["checkpoint"] > 0 and seconds["evaluation"] > 0
    assert record["global_step"] == 6 and record["step_time_median"] > 0 and record["ended"]
    assert run.read_record(folder)["attempts"][0]["attempt"] == 0

    summary = goodput_report.summarize(folder)
    assert summary["steps"] == 6 and summary["failures"] == 0 and len(summary["attempts"]) == 1
    assert math.isclose(sum(summary["shares"].values()), 1.0, rel_tol=1e-9)
    assert summary["saves"] == 2 and summary["checkpoint_interval"]["current_interval_steps"] == 3
    assert "no failure in this run" in summary["checkpoint_interval"]["note"]

    from fabric_core.cli import main  # the `fabric` command, in this process

    assert main(["goodput", str(folder), "--mtbf", "3600"]) == 0
    printed = capsys.readouterr().out
    assert "productive" in printed and "checkpoint interval (Young/Daly)" in printed and "MTBF 3600 s (given)" in printed
    picture = main(["goodput", str(folder), "--png", str(tmp_path / "g.png")])
    if importlib.util.find_spec("matplotlib") is not None:
        assert picture == 0 and (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the XLA lane's venv: the picture needs an optional package, and says which
        assert picture == 1 and "needs matplotlib" in capsys.readouterr().err and not (tmp_path / "g.png").exists()
    assert main(["goodput", str(tmp_path)]) == 1
    assert "has no goodput/ folder" in capsys.readouterr().err
    assert main(["goodput", str(folder), "--mtbf", "-1"]) == 1 and "--mtbf must be a positive" in capsys.readouterr().err


def test_a_resumed_attempt_counts_restart_and_redone_steps(tmp_path, monkeypatch):
    folder, ckpts = tmp_path / "run", tmp_path / "ckpts"
    monkeypatch.setenv(run.JOB_ID_VARIABLE, "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _train(Fabric(accelerator="cpu", run_dir=folder), 8, folder=ckpts, save_every=4)
    first = goodput.current()
    first.flush()  # attempt 0 "dies" after step 8 (no clean end)
    goodput.stop()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fabric = Fabric(accelerator="cpu", run_dir=folder)
    assert fabric.run_info.attempt == 1
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(ckpts / "step-004.ckpt", state)  # back to step 4: steps 4..7 are computed again
    ledger = goodput.current()
    assert ledger is not first and (ledger.global_step, ledger.resumed_from, ledger.redo_until) == (4, 4, 8)
    for _ in range(6):
        fabric.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
    assert ledger.redone > 0 and ledger.global_step == 10
    ledger.ended = True
    ledger.flush()
    summary = goodput_report.summarize(folder, mtbf_s=None)
    rows = summary["attempts"]
    assert [r["outcome"] for r in rows] == ["failed", "finished"] and rows[1]["resumed_from_step"] == 4
    assert summary["seconds"]["restart"] > 0 and summary["seconds"]["redone"] > 0 and summary["failures"] == 1
    interval = summary["checkpoint_interval"]  # one failure in the run: its MTBF is measured
    assert interval["mtbf_from"] == "run" and interval["daly_s"] > 0 and interval["daly_steps"] >= 1


def test_young_daly():
    found = goodput_report.young_daly(10.0, 3600.0)
    assert math.isclose(found["young_s"], math.sqrt(2 * 10 * 3600))
    ratio = 10 / 7200
    assert math.isclose(found["daly_s"], math.sqrt(72000) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 10)
    assert 0 < found["waste_share"] < 0.1
    assert goodput_report.young_daly(100.0, 40.0)["daly_s"] == 40.0  # saving costs more than half the MTBF
    with pytest.raises(ValueError, match="must be positive"):
        goodput_report.young_daly(0, 10)


def _chunk(step: int, extra: dict[int, float], noise: float = 0.0, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    entries = []
    for rank in range(4):
        marks = []
        for _ in range(4):
            jitter = float(torch.rand(1, generator=generator)) * noise
            pre = 0.01 + jitter + extra.get(rank, 0.0)
            marks.append([pre, pre + 0.02, 0.05 + max(extra.values(), default=0.0)])
        entries.append({"rank": rank, "host": "h", "step": step, "marks": marks})
    return entries


def test_straggler_named_after_persistent_slow_chunks_and_waiting_estimated():
    watch = StragglerWatch()
    named = [watch.add(_chunk(4 * i, {2: 0.2})) for i in range(PERSISTENCE + 2)]
    assert [len(n) for n in named] == [0] * (PERSISTENCE - 1) + [1, 0, 0]  # once per episode
    straggler = named[PERSISTENCE - 1][0]
    assert (straggler.rank, straggler.since_step, straggler.host) == (2, 0, "h")
    assert math.isclose(straggler.slower_s, 0.2, rel_tol=1e-6) and straggler.slower_share > 0.7
    assert "rank 2 (h) is 200 ms per step slower" in straggler.message()
    assert watch.waiting[2] == 0 and math.isclose(watch.waiting[0], 0.2 * 4 * (PERSISTENCE + 2), rel_tol=1e-6)

    calm = StragglerWatch()  # equal ranks with a jitter of 3 ms per step: nobody is named
    assert not any(calm.add(_chunk(4 * i, {}, noise=0.003, seed=i)) for i in range(200))
    one_off = StragglerWatch()  # one slow chunk is a hiccup, not a straggler
    assert not any(one_off.add(_chunk(4 * i, {1: 0.3} if i == 3 else {})) for i in range(10))


def test_sections_and_count_step_as_refuse_bad_input():
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(ValueError, match="other than the ledger's own categories"):
        with fabric.section("productive"):
            pass
    with pytest.raises(ValueError, match="positive number of seconds"):
        with fabric.section("evaluation", hang_limit=0):
            pass
    with pytest.raises(ValueError, match="such as 'quorum'"):
        goodput.count_step_as("")


def test_hang_limits_follow_the_run():
    assert hang.current_limits().why == "start-up, before the first step"  # no step yet
    fixed = hang.current_limits(10.0)
    assert (fixed.name, fixed.end) == (10.0, 10.0)
    with goodput.section("evaluation", hang_limit=300):
        assert hang.current_limits(10.0)[:2] == (300.0, 300.0)  # a declared limit wins over FABRIC_HANG_TIMEOUT
        assert hang.current_limits()[:2] == (300.0, 600.0)
    with goodput.section("evaluation"):
        assert hang.current_limits().name == hang.SECTION_S
    with goodput.section(goodput.CHECKPOINT):
        assert hang.current_limits().name == hang.CHECKPOINT_S


def test_chaos_schedule_is_seeded_and_parsed():
    kinds = ["kill", "hang", "slow", "node_kill", "disk_full", "stop"]
    one = make_schedule(kinds, seed=7, world_size=4, first_step=5, last_step=60, processes_per_node=2)
    assert schedule_json(one) == schedule_json(make_schedule(kinds, seed=7, world_size=4, first_step=5, last_step=60, processes_per_node=2))
    assert schedule_json(one) != schedule_json(make_schedule(kinds, seed=8, world_size=4, first_step=5, last_step=60, processes_per_node=2))
    assert sorted(f.kind for f in one) == sorted(["kill", "hang", "slow", "kill", "disk_full", "stop"])
    assert all(5 <= f.step <= 60 for f in one) and [f.step for f in one] == sorted(f.step for f in one)
    assert any(f.node is not None and f.hits(2, f.node) for f in one)  # the node kill hits that node's ranks
    assert [f.kind for f in chaos.parse(schedule_json(one))] == [f.kind for f in one]
    with pytest.raises(ValueError, match="Unknown fault kind"):
        make_schedule(["explode"], seed=0, world_size=2, first_step=1, last_step=5)
    with pytest.raises(ValueError, match="must be JSON"):
        chaos.parse("kill at 5")
    with pytest.raises(ValueError, match="names its ranks"):
        chaos.Fault("kill", 3)


def test_an_injected_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(64, 64))
    target = tmp_path / "last.ckpt"
    fabric.save(target, {"model": model})
    before = target.read_bytes()
    with torch.no_grad():
        model.weight.add_(1.0)
    commit.fail_next_write = OSError(errno.ENOSPC, "No space left on device (injected)")
    with pytest.raises(OSError, match="No space left to save the checkpoint") as raised:
        fabric.save(target, {"model": model})
    assert raised.value.errno == errno.ENOSPC and commit.fail_next_write is None  # taken by that write only
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    fabric.save(target, {"model": model})  # the next save works
    assert target.read_bytes() != before


def test_the_shares_go_to_the_loggers(tmp_path, monkeypatch):
    # Not by default: a script's loggers hold what it logged. Records are kept beside the loggers' output.
    fabric = Fabric(accelerator="cpu", loggers={"csv": {"root_dir": str(tmp_path / "plain"), "name": "csv"}})
    _train(fabric, 2)
    fabric.log("loss", 1.0, step=0)
    assert fabric.run_info.dir == tmp_path / "plain" / "runs" / fabric.run_info.id and not fabric.run_info.chosen
    fabric.teardown()
    assert "goodput" not in (tmp_path / "plain" / "csv" / "version_0" / "metrics.csv").read_text()
    assert (fabric.run_info.dir / "goodput" / "attempt-000" / "rank-00000.json").exists()
    goodput.stop()

    # Asked for (`fabric.log_goodput()`), or by choosing the run folder: at teardown.
    monkeypatch.setenv(run.RUN_ID_VARIABLE, "chosen")
    fabric = Fabric(accelerator="cpu", loggers={"csv": {"root_dir": str(tmp_path), "name": "csv"}})
    _train(fabric, 4)
    fabric.log("loss", 1.0, step=0)
    assert fabric.run_info.dir == tmp_path / "runs" / "chosen" and fabric.run_info.chosen
    asked = fabric.log_goodput(step=1)
    assert set(asked) >= {"goodput/goodput", "goodput/startup_share"} and 0 < asked["goodput/productive_share"] < 1
    fabric.teardown()
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "goodput/goodput" in header and "goodput/productive_share" in header and "goodput/startup_share" in header
    assert len(rows) == 4  # the header, the loss, the shares asked for, the shares at teardown
    values = dict(zip(header, rows[-1].split(",")))
    assert 0 < float(values["goodput/productive_share"]) < 1 and values["step"] == "4"


def test_compiling_is_work_but_waiting_in_a_collective_is_not():
    """A recompilation after the first step can take minutes: the hang detector counts it as progress, as an import;
    a collective reached from inside compiled code is waiting, not compiling."""
    namespace: dict = {}
    exec(compile("import sys\ndef inner():\n    return sys._getframe()\n", "/x/torch/distributed/distributed_c10d.py", "exec"), namespace)
    exec(compile("import sys\nframe = sys._getframe()\nwaiting = inner()\n", "/x/torch/_dynamo/convert_frame.py", "exec"), namespace)
    assert hang._importing(namespace["frame"])
    assert not hang._importing(namespace["waiting"])
