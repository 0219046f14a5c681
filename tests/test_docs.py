"""Docs that must match the code (datasette-style meta-tests): plugin name tables, environment variables."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from fabric_core.plugins import KINDS, build_registry

REPO = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").is_file())
#: The kind named by a table header's argument, where it differs (`Fabric(loggers=...)` lists logger names).
KIND_OF_ARGUMENT = {"loggers": "logger"}


def _distribution(plugin_dir: Path) -> str:
    return re.search(r'^name\s*=\s*"([^"]+)"', (plugin_dir / "pyproject.toml").read_text(), re.M).group(1)


def _documented_names(readme: str) -> dict[str, set[str]]:
    """Names in the tables of the README's "## Names" section, by kind: from the header `Fabric(kind=...)`, or
    `kind=...` for kinds that are not arguments of `Fabric` (launchers, cluster environments)."""
    section = readme.split("## Names", 1)[1].split("\n## ", 1)[0]
    names: dict[str, set[str]] = {}
    kind = None
    for line in section.splitlines():
        header = re.match(r"\|\s*`(?:Fabric\((\w+)=\.\.\.\)|(\w+)=\.\.\.)`", line)
        if header:
            kind = header.group(1) or header.group(2)
            kind = KIND_OF_ARGUMENT.get(kind, kind)
            continue
        if kind and line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.setdefault(kind, set()).update(re.findall(r"`([^`]+)`", first_cell))
    return names


@pytest.mark.parametrize("plugin_dir", PLUGINS, ids=[p.name for p in PLUGINS])
def test_every_name_in_a_plugin_readme_is_registered_and_the_reverse(plugin_dir):
    distribution = _distribution(plugin_dir)
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed in this environment: its names cannot be registered here")
    registry = build_registry()
    documented = _documented_names((plugin_dir / "README.md").read_text())
    assert documented, f"{plugin_dir}/README.md needs a '## Names' table"
    assert set(documented) <= set(KINDS), f"{plugin_dir}/README.md documents unknown kinds: {set(documented) - set(KINDS)}"
    for kind in KINDS:
        registered = {e.name for e in registry.entries(kind) if e.distribution == distribution}
        assert documented.get(kind, set()) == registered, f"{distribution} {kind} names: README vs registry"


def _fabric_variables_in_code() -> set[str]:
    found: set[str] = set()
    for root in (REPO / "core" / "src", REPO / "plugins"):
        for path in root.rglob("*.py"):
            found.update(re.findall(r"\bFABRIC_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    return found


def test_every_fabric_variable_read_in_code_is_documented_and_the_reverse():
    documented = set(re.findall(r"`(FABRIC_[A-Z_]+)`", (REPO / "docs" / "environment-variables.md").read_text()))
    in_code = _fabric_variables_in_code()
    assert in_code - documented == set(), "document these in docs/environment-variables.md"
    assert documented - in_code == set(), "documented but never read"


def _overridable_base_classes() -> list[type]:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.launchers.base import Launcher
    from fabric_core.precision.base import Precision
    from fabric_core.strategies import (
        Collectives,
        OneProcessCollectives,
        ParallelStrategy,
        ProcessGroupCollectives,
        ProcessPerDevice,
        Strategy,
    )

    return [Strategy, ProcessPerDevice, Collectives, OneProcessCollectives, ProcessGroupCollectives, ParallelStrategy,
            Precision, Launcher, Accelerator, ClusterEnvironment]  # fmt: skip


@pytest.mark.parametrize("cls", _overridable_base_classes(), ids=lambda c: c.__name__)
def test_every_method_a_plugin_may_override_has_a_docstring(cls):
    """``help()`` on any public method or property of a base class shows what it is for, not a section banner."""
    missing = []
    for name, obj in vars(cls).items():
        if name.startswith("_"):
            continue
        function = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
        if callable(function) and len((function.__doc__ or "").split()) < 4:
            missing.append(name)
    assert not missing, f"{cls.__name__}: write a docstring (when it is called, with what, what it returns) for {missing}"


# ---------------------------------------------------------------------------------------------- docs/plugins.md
PLUGINS_MD = REPO / "docs" / "plugins.md"


def test_the_first_party_distributions_named_in_plugins_md_are_the_cores_list():
    from fabric_core.plugins.builtin import FIRST_PARTY

    text = " ".join(PLUGINS_MD.read_text().split())  # sentences wrap over lines
    sentence = re.search(r"\*\*first-party distributions\*\* \(([^)]*)\)", text)
    assert sentence, "docs/plugins.md: the load order names the first-party distributions"
    assert set(re.findall(r"`(fabric-[a-z0-9-]+)`", sentence.group(1))) == set(FIRST_PARTY)


def test_the_plugins_json_example_is_shaped_and_valued_like_a_real_report(plugin_sites):
    """The `fabric plugins --json` example of docs/plugins.md against a real report (the "zoo" site: the example
    plugin, a broken plugin and a name conflict, beside this venv's own plugins): the same keys at every level,
    and its example entry and first-party plugin hold real values."""
    import json

    block = PLUGINS_MD.read_text().split("`--json` prints the same report as JSON:", 1)[1]
    example = json.loads(block.split("```json", 1)[1].split("```", 1)[0])
    done = plugin_sites.run("zoo", ["fabric", "plugins", "--json"])
    assert done.returncode == 0, done.stderr
    real = json.loads(done.stdout)
    assert list(example) == list(real)
    for key in ("entries", "plugins", "failures", "conflicts"):
        assert real[key] and example[key], key
        assert set(example[key][0]) == set(real[key][0]), key
    entries = {(e["kind"], e["name"]): e for e in real["entries"]}
    for shown in example["entries"]:
        actual = entries[(shown["kind"], shown["name"])]
        assert {k: v for k, v in shown.items() if k != "description"} == {k: v for k, v in actual.items() if k != "description"}
    plugins = {p["plugin"]: p for p in real["plugins"]}
    for shown in example["plugins"]:
        if shown["first_party"]:
            assert shown == plugins[shown["plugin"]], "docs/plugins.md shows hooks the plugin does not answer"
