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
