"""Every distribution is packaged alike: PEP 639 license metadata, classifiers, keywords, URLs, ``py.typed``.

The metadata is read from each ``pyproject.toml`` and, for what users actually receive, from wheels built here
(without build isolation, from copies of the sources). The full install story (a fresh venv with only torch, then
2-process runs) is the bare-install lane, ``make test-bare``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = [REPO / "core", *sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))]


def _project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def _name(folder: Path) -> str:
    return _project(folder)["project"]["name"]


def _package(folder: Path) -> str:
    return _name(folder).replace("-", "_")


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_pyproject_metadata(folder: Path) -> None:
    config = _project(folder)
    project = config["project"]
    assert project["license"] == "Apache-2.0", "PEP 639: an SPDX expression, not a table"
    assert project["license-files"] == ["LICENSE"]
    assert (folder / "LICENSE").read_text() == (REPO / "LICENSE").read_text(), "a copy of the repository's LICENSE"
    requires = config["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77 for r in requires), requires
    classifiers = project["classifiers"]
    assert not [c for c in classifiers if c.startswith("License ::")], "PEP 639 replaces License classifiers"
    for expected in ("Typing :: Typed", "Programming Language :: Python :: 3", "Development Status :: 3 - Alpha"):
        assert expected in classifiers
    assert len(project["keywords"]) >= 4 and "pytorch" in project["keywords"]
    assert project["readme"] == "README.md" and (folder / "README.md").is_file()
    urls = project["urls"]
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(urls)
    assert urls["Homepage"] == _project(REPO / "core")["project"]["urls"]["Homepage"], "one home for every distribution"
    package = _package(folder)
    assert config["tool"]["setuptools"]["package-data"][package] == ["py.typed"]
    assert (folder / "src" / package / "py.typed").is_file()
    if folder.name != "core":
        assert project["entry-points"]["fabric.plugins"], "a plugin registers through the entry-point group"
        assert any(d.startswith("fabric-core>=") for d in project["dependencies"])


def test_core_extras_name_every_plugin_distribution() -> None:
    extras = _project(REPO / "core")["project"]["optional-dependencies"]
    plugins = {_name(f) for f in FOLDERS if f.name != "core"}
    offered = {req.split(">")[0].split("=")[0] for reqs in extras.values() for req in reqs}
    assert plugins <= offered, f"no fabric-core extra installs {sorted(plugins - offered)}"
    for folder in FOLDERS[1:]:
        short = _name(folder).removeprefix("fabric-")
        assert extras[short] == [f"{_name(folder)}>=0.1,<0.2"], f"`fabric-core[{short}]` installs {_name(folder)}"
    everything = {r for name, reqs in extras.items() if name != "all" for r in reqs}
    assert set(extras["all"]) == everything, "`[all]` installs every other extra"


def test_console_scripts() -> None:
    scripts = _project(REPO / "core")["project"]["scripts"]
    assert scripts == {"fabric": "fabric_core.cli:main", "fabric-core": "fabric_core.cli:main"}


def test_wheels_carry_the_metadata_and_build_without_warnings(tmp_path: Path) -> None:
    copies = []
    for folder in FOLDERS:
        copy = tmp_path / "src" / folder.name
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(str(copy))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*command, "-w", str(tmp_path / "wheels"), *copies], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    output = "\n".join(
        line for line in (done.stdout + done.stderr).splitlines() if not re.match(r"WARNING: Location '.*' is ignored", line)
    )
    assert not re.search(r"warn|deprecat", output, re.IGNORECASE), output
    for folder in FOLDERS:
        package = _package(folder)
        (wheel,) = (tmp_path / "wheels").glob(f"{package}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
            metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        assert f"{package}/py.typed" in names
        assert f"{info}/licenses/LICENSE" in names
        assert metadata["License-Expression"] == "Apache-2.0"
        assert metadata["License"] is None, "the deprecated License field is gone"
        assert "Typing :: Typed" in metadata.get_all("Classifier")
        assert any(u.startswith("Homepage, https://") for u in metadata.get_all("Project-URL"))
        assert metadata["Keywords"]
