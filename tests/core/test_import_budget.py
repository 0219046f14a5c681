"""What ``import fabric_core`` + ``Fabric(accelerator="cpu")`` imports stays small (the import budget, issue 20 item 8).

The time itself is measured by ``benchmarks/sections/startup.py``, side by side with a bare ``import torch``; here
the modules deferred to the calls that need them are checked to stay deferred.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from fabric_core.plugins.entry_points import group_entry_points as _group_entry_points
from fabric_core.plugins.registry import ENTRY_POINT_GROUP

#: Imported only by a save, a load or a logger that is used: none of them by constructing a Fabric.
DEFERRED = (
    "fabric_core.io.background",
    "fabric_core.io.commit",
    "fabric_core.io.format",
    "fabric_core.io.location",
    "fabric_core.io.retention",
    "fabric_core.io.single_file",
    "fabric_core.io.snapshot",
    "fabric_core.io.state",
    "fabric_core.loggers.base",
    "fabric_core.loggers.csv",
    "fabric_core.loggers.tensorboard",
)

#: Not imported by ``Fabric(accelerator="cpu")`` in a plain process at all: the other accelerators and precisions,
#: the process-group side of the strategies, and the cluster environments whose variables are not set.
UNUSED_HERE = (
    "fabric_core.accelerators.cuda",
    "fabric_core.accelerators.mps",
    "fabric_core.environments.kubeflow",
    "fabric_core.environments.lsf",
    "fabric_core.environments.mpi",
    "fabric_core.environments.torchelastic",
    "fabric_core.precision.double",
    "fabric_core.precision.half",
    "fabric_core.strategies.layout",
    "fabric_core.strategies.parallel",
    "fabric_core.utilities.dtensor",
)


def test_constructing_a_fabric_defers_the_modules_it_does_not_need(tmp_path):
    code = textwrap.dedent(
        f"""
        import json, sys
        import torch
        from fabric_core import Fabric
        fabric = Fabric(accelerator="cpu")
        deferred = {DEFERRED!r}
        before = sorted(m for m in deferred + {UNUSED_HERE!r} if m in sys.modules)
        fabric.save({str(tmp_path / "ckpt.pt")!r}, {{"model": torch.nn.Linear(2, 2)}})
        fabric.load({str(tmp_path / "ckpt.pt")!r})
        from fabric_core.loggers import CSVLogger
        after = sorted(m for m in deferred if m in sys.modules)
        print(json.dumps([before, after]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "LSB_", "OMPI_", "PMI_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before == []
    # Saving, loading and a logger do import them: the check above can see an import.
    assert set(after) >= {"fabric_core.io.background", "fabric_core.io.location", "fabric_core.loggers.csv"}


def test_entry_point_scan_finds_what_importlib_metadata_finds():
    """The scan that parses only the files naming the group finds the same entry points (every installed plugin)."""

    def key(ep):
        return ep.name, ep.value, ep.dist.name if ep.dist is not None else None

    standard = sorted(map(key, entry_points(group=ENTRY_POINT_GROUP)))
    assert standard, "no fabric plugin is installed in this environment"
    assert sorted(map(key, _group_entry_points())) == standard


def test_entry_point_scan_after_the_importlib_metadata_backport_is_imported():
    """The backport (imported by many packages) replaces the standard finder's method: the scan then falls back to
    the standard call and still finds every plugin."""
    code = textwrap.dedent(
        """
        import json
        import importlib_metadata  # noqa: F401 (its import patches the finders)
        from importlib.metadata import entry_points
        from fabric_core.plugins.entry_points import group_entry_points as _group_entry_points

        key = lambda ep: [ep.name, ep.value]
        print(json.dumps([sorted(map(key, entry_points(group="fabric.plugins"))), sorted(map(key, _group_entry_points()))]))
        """
    )
    pytest.importorskip("importlib_metadata")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    standard, ours = json.loads(done.stdout.strip().splitlines()[-1])
    assert standard and ours == standard


def test_a_lazy_submodule_is_imported_when_first_read_and_listed_before():
    """``fabric_core.io.background`` is read by ``Fabric.save`` through the package: listed by ``dir`` before it is
    imported, imported on the first read, and a name that is neither an export nor a submodule is an AttributeError."""
    code = textwrap.dedent(
        """
        import json, sys
        import fabric_core.io as io
        listed = "background" in dir(io)
        before = "fabric_core.io.background" in sys.modules
        module = io.background
        after = "fabric_core.io.background" in sys.modules
        try:
            io.no_such_part
            missing = "no error"
        except AttributeError as err:
            missing = str(err)
        print(json.dumps([listed, before, after, module.__name__, missing]))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed, before, after, name, missing = json.loads(done.stdout.strip().splitlines()[-1])
    assert (listed, before, after, name) == (True, False, True, "fabric_core.io.background")
    assert "no_such_part" in missing
