"""The strategies docs/plugins.md teaches a third party to write, run as written: real processes, real gloo."""

from __future__ import annotations

import json
import textwrap

import pytest

PARALLEL_EXAMPLE = textwrap.dedent(
    """
    import json
    import sys
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from fabric_core import Fabric
    from fabric_core.plugins import build_registry, hookimpl, set_registry
    from fabric_core.strategies import ParallelStrategy


    class AveragingStrategy(ParallelStrategy):
        def setup_module(self, module):
            return DistributedDataParallel(module, bucket_cap_mb=8)

        def unwrap_module(self, module):
            return module.module if isinstance(module, DistributedDataParallel) else module


    class Plugin:
        @hookimpl
        def fabric_register_strategies(self, registrar):
            registrar.add("averaging", AveragingStrategy)


    # Every rank (the launcher re-runs this script) registers the plugin the same way.
    set_registry(build_registry(extra_plugins=(Plugin(),)))
    fabric = Fabric(accelerator="cpu", strategy="averaging", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.full((2, 4), float(fabric.global_rank + 1))
    fabric.backward(model(x).sum())
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    import sys
    from pathlib import Path

    Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps({"rank": fabric.global_rank,
        "world": fabric.world_size, "sum": total.item(), "grad": model.module.weight.grad.tolist(),
        "strategy": type(fabric.strategy).__name__}))
    """
)


@pytest.mark.multiprocess
def test_documented_parallel_strategy_example_runs_two_processes(tmp_path):
    """docs/plugins.md's ParallelStrategy example: two real processes, gradients averaged by DDP."""
    import os
    import subprocess
    import sys

    from jobs import free_port

    script = tmp_path / "averaging.py"
    script.write_text(PARALLEL_EXAMPLE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "TORCHELASTIC_", "SLURM_"))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in rows] == [0, 1] and {r["world"] for r in rows} == {2}
    assert {r["strategy"] for r in rows} == {"AveragingStrategy"} and {r["sum"] for r in rows} == {1.0}
    assert rows[0]["grad"] == rows[1]["grad"] == [[3.0, 3.0, 3.0, 3.0]]  # mean of 2*1 and 2*2 per weight


def _sharded_walkthrough(tmp_path):
    """Write the walk-through's files into ``tmp_path/site/fabric_mything`` exactly as docs/plugins.md prints them."""
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    section = docs[docs.index("### Walk-through: a sharded strategy") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    package = tmp_path / "site" / "fabric_mything"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for block in blocks:
        first = block.splitlines()[0]
        assert first.startswith("# fabric_mything/"), first
        (package / first.split("/", 1)[1].split(":", 1)[0].strip()).write_text(block)
    assert {p.name for p in package.iterdir()} == {"__init__.py", "sharded.py", "train.py"}
    return tmp_path / "site"


def test_documented_sharded_strategy_matches_one_process(tmp_path):
    """docs/plugins.md's sharded strategy walk-through, as printed: two processes of tensor parallelism train, clip and
    save one checkpoint file, which holds what one process training the same model gets."""
    import os
    import subprocess
    import sys

    import torch
    from jobs import job_env

    site = _sharded_walkthrough(tmp_path)
    target = tmp_path / "trained.ckpt"
    env = job_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    done = subprocess.run(
        [sys.executable, "-m", "fabric_mything.train", str(target)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checkpoint = torch.load(target, weights_only=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert checkpoint["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, value in model.state_dict().items():
        assert torch.allclose(checkpoint["model"][name], value, atol=1e-5), name
    assert set(checkpoint["optimizer"]["state"]) == {0, 1, 2, 3}  # whole AdamW state, one entry per parameter
