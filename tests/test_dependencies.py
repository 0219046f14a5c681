"""The guard of ``tests/dependencies.py``: in the venv `make setup` made, a dependency it installs that is missing
stops the run, and one that cannot be imported fails the tests that need it instead of skipping them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dependencies
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_required_list_is_read_from_what_make_setup_installs():
    wanted = dependencies.required()
    # every distribution of the repository (Makefile DISTS), their dependencies, the dev requirements, NO_DEPS_DEV
    for name in ("fabric-core", "fabric-bnb", "fabric-ray", "fabric-xla", "bitsandbytes", "torchao", "torchft",
                 "deepspeed", "ray", "s3fs", "moto", "torchdata", "numpy", "pytest-xdist"):  # fmt: skip
        assert name in wanted, (name, sorted(wanted))
    assert wanted["bitsandbytes"] == "plugins/bnb/pyproject.toml" and wanted["torchdata"] == "Makefile (NO_DEPS_DEV)"


def test_the_guard_is_on_in_make_setups_venv_only(monkeypatch):
    monkeypatch.delenv(dependencies.FORCE_VARIABLE, raising=False)
    prefix = Path(sys.prefix)
    assert dependencies.is_make_setup_venv() == (prefix.name == ".venv" and (prefix / ".installed").is_file())
    monkeypatch.setenv(dependencies.FORCE_VARIABLE, "required")
    assert dependencies.is_make_setup_venv()


def test_a_missing_distribution_is_named_with_the_file_that_asks_for_it(monkeypatch):
    monkeypatch.setattr(dependencies, "required", lambda: {"pytest": "requirements-dev.txt", "no-such-dist-x": "plugins/x/pyproject.toml"})
    absent = dependencies.missing()
    assert absent == {"no-such-dist-x": "plugins/x/pyproject.toml"}
    message = dependencies.report(absent)
    assert "no-such-dist-x (plugins/x/pyproject.toml)" in message and "make setup" in message


@pytest.mark.skipif(not dependencies.is_make_setup_venv(), reason="checks the guard of the venv `make setup` made")
def test_a_dependency_that_cannot_be_imported_fails_its_tests_instead_of_skipping_them(tmp_path):
    """bitsandbytes made unimportable (as a broken install is) in a pytest run of a fabric-bnb test module in make
    setup's venv: the module errors, naming it; nothing is skipped."""
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', '--rootdir', {str(REPO)!r},"
        f" {str(REPO / 'tests/plugins/bnb/test_bnb_memory.py')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode not in (0, 5), out.stdout[-3000:]
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-3000:]
    assert "'bitsandbytes' cannot be imported" in out.stdout and "1 error" in out.stdout, out.stdout[-3000:]


#: the libraries our plugins integrate, by the distribution that asks for them (their ranges: constraints.txt)
INTEGRATED = {"torchft": "plugins/ft", "deepspeed": "plugins/deepspeed", "torchao": "plugins/ao",
              "ray": "plugins/ray", "bitsandbytes": "plugins/bnb"}  # fmt: skip


def _constraints() -> dict[str, str]:
    import re

    text = (REPO / "constraints.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)\s*$", text, re.M))


def _requirement(folder: str, name: str):
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"] if dependencies._name(r) == name]
    assert len(found) == 1, (folder, name, project["dependencies"])
    return found[0]


def test_library_distributions_ask_for_ranges_and_ci_installs_a_version_inside_each():
    """Issue 37: no `==` pin in a library distribution; constraints.txt holds the exact version CI installs, which
    must lie inside the range (the lowest version we test is the range's floor)."""
    pinned = _constraints()
    assert set(INTEGRATED) <= set(pinned), sorted(pinned)
    for name, folder in INTEGRATED.items():
        requirement = _requirement(folder, name)
        specifiers = {s.operator for s in requirement.specifier}
        assert "==" not in specifiers and ">=" in specifiers, (folder, str(requirement))
        floor = next(s.version for s in requirement.specifier if s.operator == ">=")
        assert pinned[name] == floor, f"{name}: CI installs {pinned[name]}, {folder} says the lowest tested is {floor}"
        assert requirement.specifier.contains(pinned[name]), (name, pinned[name], str(requirement))
    for folder in dependencies._make_variable((REPO / "Makefile").read_text(), "DISTS"):
        import tomllib

        project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        assert not [r for r in project.get("dependencies", []) if "==" in r], (folder, project["dependencies"])


def test_the_install_hints_give_the_distributions_own_range():
    """The "pip install ..." of an unavailable precision is the plugin's own requirement, so the two cannot drift."""
    from packaging.requirements import Requirement

    fabric_ao = dependencies.strict_importorskip("fabric_ao.precision")
    fabric_bnb = dependencies.strict_importorskip("fabric_bnb.precision")
    for hint, folder, name in ((fabric_ao.TORCHAO_REQUIREMENT, "plugins/ao", "torchao"),
                               (fabric_bnb.BNB_REQUIREMENT, "plugins/bnb", "bitsandbytes")):  # fmt: skip
        wanted = _requirement(folder, name)
        assert Requirement(hint).name == name and Requirement(hint).specifier == wanted.specifier, (hint, str(wanted))


def test_ci_installs_the_constrained_versions():
    """The venv `make setup` made holds exactly the versions of constraints.txt (-c is passed to every install)."""
    if not dependencies.is_make_setup_venv():
        pytest.skip("only the venv `make setup` made installs with constraints.txt")
    import importlib.metadata

    for name, version in _constraints().items():
        assert importlib.metadata.version(name) == version, name
