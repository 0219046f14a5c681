"""A third-party sharded checkpoint format, built from docs/plugins.md alone, on two real processes.

The example's code blocks are taken from the page as they are, written into a package ``fabric_mything`` and used
by a 2-rank job (gloo): save, load into fresh objects, a single-device run that reads the folder through the
reader hook, and the same at an S3 URL (a real S3-compatible server on loopback).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from jobs import read_json, run_ranks

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch
    from fabric_core import Fabric
    from fabric_core.io.location import CheckpointLocation
    from fabric_mything.checkpoint import PerRankFormat
    from fabric_mything.strategy import PerRankStrategy

    out, target = Path(sys.argv[1]), sys.argv[3]
    fabric = Fabric(accelerator="cpu", strategy=PerRankStrategy(), devices=2)
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(rank)  # every rank has its own state: the format keeps each rank's part
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    optimizer.step()
    fabric.save(target, {"model": model, "optimizer": optimizer, "step": 7 + rank})
    # On return (every rank) the folder is published at the target.
    published = PerRankFormat(rank).recognises(CheckpointLocation.of(target))
    fresh = torch.nn.Linear(4, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = fabric.load(target, state)
    json.dump({
        "published": published,
        "same_weights": torch.equal(fresh.weight, model.weight),
        "step": state["step"],
        "remainder": sorted(remainder),
        "weight": model.weight.tolist(),
    }, open(out / f"rank{rank}.json", "w"))
    """
)

SINGLE_READER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch
    from fabric_core import Fabric
    from fabric_core.plugins import build_registry, hookimpl, set_registry
    from fabric_mything.checkpoint import PerRankFormat

    class Plugin:  # what fabric_mything/register.py would hold
        @hookimpl
        def fabric_register_checkpoint_formats(self, registrar):
            registrar.add("per_rank", PerRankFormat, rank=0)

    set_registry(build_registry(extra_plugins=(Plugin(),)))
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 2)
    remainder = fabric.load(sys.argv[3], {"model": model})
    json.dump({"weight": model.weight.tolist(), "remainder": sorted(remainder)}, open(Path(sys.argv[1]) / "single.json", "w"))
    """
)


def _example_package(tmp_path: Path) -> Path:
    """Write the docs' example into ``tmp_path/site/fabric_mything`` exactly as printed."""
    docs = (REPO / "docs" / "plugins.md").read_text()
    section = docs[docs.index("### Example: a sharded format") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:2]
    site = tmp_path / "site"
    package = site / "fabric_mything"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for block in blocks:
        first = block.splitlines()[0]
        assert first.startswith("# fabric_mything/"), first
        name = first.split("/", 1)[1].split(":", 1)[0].strip()
        (package / name).write_text(block)
    assert {p.name for p in package.iterdir()} == {"__init__.py", "checkpoint.py", "strategy.py"}
    return site


def _run(tmp_path: Path, target: str, env_setup=None) -> tuple[list[dict], dict]:
    site = _example_package(tmp_path)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    run_ranks(worker, str(tmp_path), str(site), target, timeout=180, tmp_path=tmp_path)
    rows = [read_json(tmp_path / f"rank{r}.json") for r in (0, 1)]
    reader = tmp_path / "single.py"
    reader.write_text(SINGLE_READER)
    run_ranks(reader, str(tmp_path), str(site), target, world_size=1, timeout=120, tmp_path=tmp_path)
    return rows, read_json(tmp_path / "single.json")


def _check(rows: list[dict], single: dict) -> None:
    assert all(r["published"] for r in rows), rows
    assert all(r["same_weights"] for r in rows) and [r["step"] for r in rows] == [7, 8]
    assert rows[0]["weight"] != rows[1]["weight"]  # each rank restored its own part
    assert single["weight"] == rows[0]["weight"] and single["remainder"] == ["optimizer", "step"]


@pytest.mark.multiprocess
def test_the_documented_sharded_format_saves_and_loads_on_two_ranks(tmp_path):
    target = tmp_path / "ckpts" / "step-7"
    rows, single = _run(tmp_path, str(target))
    _check(rows, single)
    assert sorted(p.name for p in target.iterdir()) == ["per-rank.json", "rank-0.pt", "rank-1.pt"]
    assert [p.name for p in target.parent.iterdir()] == ["step-7"]  # nothing hidden left beside it


@pytest.mark.multiprocess
def test_the_documented_sharded_format_at_an_s3_url(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3_server

    server, endpoint = s3_server.start()
    try:
        s3_server.create_bucket(endpoint, "formats")
        for key, value in s3_server.client_env(endpoint).items():
            monkeypatch.setenv(key, value)  # the rank processes inherit them through job_env
        rows, single = _run(tmp_path, "s3://formats/run/step-7")
        _check(rows, single)
        s3_server.configure_this_process(endpoint)
        import fsspec

        fs = fsspec.filesystem("s3")
        names = sorted(p.rpartition("/")[2] for p in fs.find("formats/run/step-7"))
        assert names == [".fabric-committed", "per-rank.json", "rank-0.pt", "rank-1.pt"], names
    finally:
        server.stop()



FAILING_WORKER = textwrap.dedent(
    """
    import json, sys, traceback
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch
    from fabric_core import Fabric
    from fabric_mything.checkpoint import PerRankFormat
    from fabric_mything.strategy import PerRankStrategy

    class FailsOnRankOne(PerRankFormat):
        def write(self, location, state, context, **kwargs):
            def write_parts(folder):
                if self.rank == 1:
                    raise_disk_full(folder)
                with folder.child(f"rank-{self.rank}.pt").open("wb") as file:
                    torch.save(context.state_to_save(state, None), file)

            from fabric_core.io.commit import commit_directory
            commit_directory(location, write_parts, context.coordinator)

    def raise_disk_full(folder):
        raise OSError(28, "No space left on device (planned, rank 1)")

    class Strategy(PerRankStrategy):
        def checkpoint_format(self):
            return FailsOnRankOne(self.global_rank)

    out, target = Path(sys.argv[1]), sys.argv[3]
    fabric = Fabric(accelerator="cpu", strategy=Strategy(), devices=2)
    fabric.launch()
    try:
        fabric.save(target, {"model": torch.nn.Linear(2, 2), "step": 1})
        row = {"raised": None}
    except Exception as err:
        row = {"raised": type(err).__name__, "message": str(err), "notes": getattr(err, "__notes__", []),
               "traceback": traceback.format_exception(err)}
    row["left_beside"] = sorted(p.name for p in Path(target).parent.iterdir())
    json.dump(row, open(out / f"failing{fabric.global_rank}.json", "w"))
    """
)


@pytest.mark.multiprocess
def test_a_rank_whose_write_fails_raises_its_own_error_and_the_others_name_it(tmp_path):
    """publish_together after rank 1's part failed: rank 1 raises its own OSError (traceback down to the write),
    rank 0 a CheckpointSaveError that says rank 1 failed and why; nothing is published, nothing staged is left."""
    site = _example_package(tmp_path)
    worker = tmp_path / "failing_worker.py"
    worker.write_text(FAILING_WORKER)
    target = tmp_path / "ckpts" / "step-1"
    target.parent.mkdir()
    run_ranks(worker, str(tmp_path), str(site), str(target), timeout=180, tmp_path=tmp_path)
    rank0, rank1 = (read_json(tmp_path / f"failing{r}.json") for r in (0, 1))
    assert rank1["raised"] == "OSError" and "No space left on device (planned, rank 1)" in rank1["message"]
    assert "raise_disk_full" in "".join(rank1["traceback"])  # its own traceback, down to where the write failed
    assert rank1["notes"] == []  # no other rank failed
    assert rank0["raised"] == "CheckpointSaveError", rank0
    assert f"Saving the checkpoint {str(target)!r} failed on rank 1: OSError: [Errno 28] No space left on device" in rank0["message"]
    assert "Nothing was published" in rank0["message"]
    assert rank0["left_beside"] == rank1["left_beside"] == []  # the staged folder was removed, nothing published
