"""Two third-party plugins written from docs/plugins.md alone, each a real installed distribution
(``tests/core/plugin_fixtures/npz_format``, ``tests/core/plugin_fixtures/local_launcher``), used the way a user uses
them: a checkpoint format through ``fabric.save(..., checkpoint_format="npz")`` (keep_last, async_save, the handle,
the loggers, loading without naming it, crash safety) and a script launcher through ``fabric run --launcher
local_procs`` on 2 processes with DDP (a job that succeeds, one whose rank fails). Their sources import nothing but
names of the plugin SDK's faces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import architecture
import pytest
from jobs import free_port, job_env
from plugin_doubles import last_json_line

from fabric_core.io.commit import is_temporary

FIXTURES = Path(__file__).resolve().parents[1] / "plugin_fixtures"
SITE = "thirdparty"


def test_the_third_party_plugins_use_only_the_plugin_sdk():
    sources = sorted((FIXTURES / "npz_format").rglob("*.py")) + sorted((FIXTURES / "local_launcher").rglob("*.py"))
    exported = {face: set(__import__(face, fromlist=["__all__"]).__all__) for face in architecture.FACES}
    imported = [(path.name, module, name) for path in sources for _, module, name in architecture.core_imports(path)]
    assert imported, "the fixtures import the core"
    assert [i for i in imported if i[1] not in exported or i[2] not in exported[i[1]]] == []


FORMAT_JOB = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy, torch
    from fabric_core import Fabric
    from fabric_core.loggers import CSVLogger

    class Recording(CSVLogger):
        def checkpoint_saved(self, location):
            saved.append((type(location).__name__, location.is_url, location.name))

    saved, out = [], Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", loggers=Recording(out / "logs"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    result = {}

    def step():
        fabric.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    for n in (1, 2, 3):  # keep_last prunes the series after each save is durable
        step()
        handle = fabric.save(out / f"ckpts/step-{n}.npz", {"model": model, "optimizer": optimizer, "step": n},
                             checkpoint_format="npz", keep_last=2)
        handle.wait()
    result["kept"] = sorted(p.name for p in (out / "ckpts").iterdir())
    result["numpy_names"] = sorted(numpy.load(out / "ckpts/step-3.npz").files)[:3]  # a plain .npz file

    # async: the snapshot is taken when save returns; changing the model afterwards does not reach the file
    saved_weight = model.weight.detach().clone()
    handle = fabric.save(out / "ckpts/step-4.npz", {"model": model, "optimizer": optimizer, "step": 4},
                         checkpoint_format="npz", async_save=True, keep_last=2)
    with torch.no_grad():
        model.weight.add_(100.0)
    handle.wait()
    result["kept_after_async"] = sorted(p.name for p in (out / "ckpts").iterdir())

    # load without naming the format: the registered format recognises its file
    fresh = torch.nn.Linear(4, 2)
    fresh_model, fresh_optimizer = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    remainder = fabric.load(out / "ckpts/step-4.npz", {"model": fresh_model, "optimizer": fresh_optimizer})
    result["remainder"] = remainder
    result["async_weight_is_the_snapshot"] = torch.equal(fresh.weight, saved_weight)
    result["optimizer_steps"] = int(fresh_optimizer.state_dict()["state"][0]["step"])
    result["loggers_saw"] = saved
    try:
        fabric.save(out / "x.npz", {"step": 0}, checkpoint_format="nzp")
    except ValueError as err:
        result["unknown_name"] = str(err)
    print(json.dumps(result))
    """
)


def test_a_third_party_format_through_fabric_save(plugin_sites, tmp_path):
    done = plugin_sites.python(SITE, FORMAT_JOB.replace("sys.argv[1]", repr(str(tmp_path))))
    assert done.returncode == 0, done.stderr[-4000:]
    result = last_json_line(done.stdout)
    assert result["kept"] == ["step-2.npz", "step-3.npz"]
    assert result["numpy_names"] == ["__tree__", "t0", "t1"]
    assert result["kept_after_async"] == ["step-3.npz", "step-4.npz"]
    assert result["remainder"] == {"step": 4}
    assert result["async_weight_is_the_snapshot"] is True and result["optimizer_steps"] == 3
    assert result["loggers_saw"] == [
        ["CheckpointLocation", False, f"step-{n}.npz"] for n in (1, 2, 3, 4)
    ]  # the location the save decided, once per save
    assert "Did you mean 'npz'?" in result["unknown_name"]


SAVER = textwrap.dedent(
    """
    import sys, torch
    from fabric_core import Fabric
    fabric = Fabric(accelerator="cpu")
    state = {"step": int(sys.argv[2]), "w": torch.randn(32 * 1024 * 1024 // 4)}  # 32 MiB
    print("saving", flush=True)
    while True:
        fabric.save(sys.argv[1], state, checkpoint_format="npz")
    """
)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_third_party_format_killed_mid_save_keeps_the_previous_checkpoint(plugin_sites, tmp_path, signum):
    target = tmp_path / "last.npz"
    first = "from fabric_core import Fabric; Fabric(accelerator='cpu').save(%r, {'step': 1}, checkpoint_format='npz')"
    assert plugin_sites.python(SITE, first % str(target)).returncode == 0
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    site = plugin_sites.site(SITE)
    saver = subprocess.Popen(
        [sys.executable, str(script), str(target), "2"], stdout=subprocess.PIPE, text=True,
        env={**job_env(), "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert saver.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 60
    while not [p for p in tmp_path.iterdir() if is_temporary(p)]:
        assert time.monotonic() < deadline, "the saver never created a temporary file"
        time.sleep(0.002)
    os.kill(saver.pid, signum)
    assert saver.wait(timeout=30) == -signum
    assert [p for p in tmp_path.iterdir() if is_temporary(p)], "the kill left its temporary file"
    check = (
        "import json; from fabric_core import Fabric; f = Fabric(accelerator='cpu');"
        f" step = f.load({str(target)!r})['step']; f.save({str(target)!r}, {{'step': 3}}, checkpoint_format='npz');"
        f" print(json.dumps([step, f.load({str(target)!r})['step']]))"
    )
    done = plugin_sites.python(SITE, check)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = last_json_line(done.stdout)
    assert before in (1, 2) and after == 3  # a whole checkpoint at every moment
    assert [p.name for p in tmp_path.iterdir() if is_temporary(p)] == []  # the next save removed what the kill left


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch
    from fabric_core import Fabric

    out, mode = Path(sys.argv[1]), sys.argv[2]
    fabric = Fabric()  # everything from `fabric run` through the launcher: accelerator, strategy, devices
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        fabric.backward(model(torch.randn(8, 4) + fabric.global_rank).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if mode == "fail" and fabric.global_rank == 1:
            raise ValueError("rank one cannot go on")
    fabric.save(out / "ddp.npz", {"model": model, "step": 3}, checkpoint_format="npz")
    fresh = torch.nn.Linear(4, 2)
    remainder = fabric.load(out / "ddp.npz", {"model": fresh})
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps({
        "world": fabric.world_size, "strategy": type(fabric.strategy).__name__, "sum": float(total),
        "remainder": remainder, "restored": torch.equal(fresh.weight, model.module.weight),
        "weights": model.module.weight.tolist(), "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
    }))
    """
)


@pytest.mark.multiprocess
def test_a_third_party_script_launcher_runs_a_two_process_ddp_job(plugin_sites, tmp_path):
    # multiprocess-check: starts ranks (fabric run --launcher local_procs --devices 2, through the fabric_run helper)
    pytest.importorskip("fabric_ddp", reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    env = {"STANDALONE_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}  # the launcher's find_free_port takes it

    def fabric_run(name: str, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        out = tmp_path / name
        out.mkdir()
        argv = ["fabric", "run", "--launcher", "local_procs", "--local-procs-grace", "2", *extra, "--accelerator",
                "cpu", "--strategy", "ddp", "--devices", "2", str(script), str(out), mode]  # fmt: skip
        return plugin_sites.run(SITE, argv, env=env, timeout=240), out

    done, out = fabric_run("ok", "ok")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert (rank["world"], rank["strategy"], rank["sum"], rank["restart"]) == (2, "DDPStrategy", 1.0, "0")
        assert rank["remainder"] == {"step": 3} and rank["restored"] is True
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP kept the replicas equal"

    done, out = fabric_run("fail", "fail")
    assert done.returncode == 1, done.stderr[-4000:]
    last_words = done.stderr[done.stderr.index("[fabric] First failure:") :]
    assert last_words.startswith("[fabric] First failure: Rank 1"), last_words
    assert "ValueError: rank one cannot go on" in last_words
    assert not list(out.glob("rank*.json")), "no rank finished: the other was stopped"
