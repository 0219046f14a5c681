"""``fabric_core.io.lazy_load``: a big checkpoint opens without being read; a tensor is read when it is used."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fabric_core import Fabric
from fabric_core.io import lazy_load

MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from fabric_core.io import lazy_load

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

    before = rss_mib()
    checkpoint = lazy_load(sys.argv[1])
    opened = rss_mib()
    names = sorted(checkpoint["model"])
    checkpoint["model"][names[0]].sum()  # read one of the four 16 MiB tensors
    one = rss_mib()
    model = torch.nn.Module()
    for name in names:
        model.register_buffer(name, torch.empty(4 * 1024 * 1024))
    model.load_state_dict(checkpoint["model"])
    print(json.dumps({"open": opened - before, "one": one - before, "step": checkpoint["step"],
                      "equal": all(torch.equal(getattr(model, n), checkpoint["model"][n]) for n in names)}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's resident memory from /proc")
def test_opening_reads_no_tensor_and_using_one_reads_only_it(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    tensors = {f"t{i}": torch.full((4 * 1024 * 1024,), float(i)) for i in range(4)}  # 4 x 16 MiB
    fabric.save(tmp_path / "big.ckpt", {"model": tensors, "step": 12}).wait()
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "big.ckpt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["step"] == 12 and result["equal"]
    assert result["open"] < 8, result  # the structure only, not 64 MiB of tensors
    assert 8 < result["one"] < 32, result  # one 16 MiB tensor, not all four


def test_lazy_tensors_survive_the_file_being_replaced(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "a.ckpt", {"w": torch.ones(1000)}).wait()
    checkpoint = lazy_load(tmp_path / "a.ckpt")
    fabric.save(tmp_path / "a.ckpt", {"w": torch.zeros(1000)}).wait()
    assert torch.equal(checkpoint["w"], torch.ones(1000))


def test_what_cannot_be_opened_lazily_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        lazy_load(tmp_path / "missing.ckpt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError, match="fabric consolidate"):
        lazy_load(tmp_path / "folder")
    with pytest.raises(ValueError, match="is a URL"):
        lazy_load("s3://bucket/ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy"):
        lazy_load(tmp_path / "legacy.pt")
