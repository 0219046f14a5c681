"""What `make setup` installs, and the guard that makes `make test` fail (not skip) when any of it is missing.

A test that needs an optional package says so with ``pytest.importorskip`` or a ``skipif``, so that the XLA lane's
deliberately partial venv (``.venv-xla``: fabric-core and fabric-xla only) and a bare machine skip what they lack.
In the venv that ``make setup`` made, the same skips would hide a broken install: a plugin whose dependency failed to
install would turn its tests into skips and ``make test`` would stay green. There:

* :func:`missing` lists every distribution ``make setup`` installs (read from the Makefile's ``DISTS`` and
  ``NO_DEPS_DEV``, each distribution's ``pyproject.toml`` and ``requirements-dev.txt``, so the list cannot drift)
  that is not installed; ``tests/conftest.py`` stops the run before the first test when it is not empty;
* :func:`strict_importorskip` replaces ``pytest.importorskip``: it imports, and an import that fails is an error
  naming the module, not a skip.

Skips stay for what the machine lacks (CUDA, Linux-only facilities, torch_xla, which only the XLA lane installs).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: ``required`` forces the guard on in another interpreter (a throwaway venv, say); it is on by itself in `.venv`.
FORCE_VARIABLE = "FABRIC_TEST_DEPENDENCIES"


def is_make_setup_venv() -> bool:
    """This interpreter is the venv ``make setup`` made (``.venv`` with its install stamp), or the guard is forced."""
    if os.environ.get(FORCE_VARIABLE) == "required":
        return True
    prefix = Path(sys.prefix)
    return prefix.name == ".venv" and (prefix / ".installed").is_file()


def _name(requirement: str) -> str:
    """``ray[train]==2.60.0 ; python_version>'3'`` -> ``ray``."""
    return re.split(r"[\s<>=!~;\[@]", requirement.strip(), maxsplit=1)[0]


def _make_variable(makefile: str, variable: str) -> list[str]:
    match = re.search(rf"^{variable}\s*:?=\s*(.*)$", makefile, re.M)
    return match.group(1).split() if match else []


def required() -> dict[str, str]:
    """Every distribution ``make setup`` installs -> the file that asks for it."""
    import tomllib

    makefile = (REPO / "Makefile").read_text()
    wanted: dict[str, str] = {}
    for line in (REPO / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            wanted.setdefault(_name(line), "requirements-dev.txt")
    for requirement in _make_variable(makefile, "NO_DEPS_DEV"):
        wanted.setdefault(_name(requirement), "Makefile (NO_DEPS_DEV)")
    for folder in _make_variable(makefile, "DISTS"):
        pyproject = f"{folder}/pyproject.toml"
        project = tomllib.loads((REPO / pyproject).read_text())["project"]
        wanted.setdefault(project["name"], pyproject)
        for requirement in project.get("dependencies", []):
            wanted.setdefault(_name(requirement), pyproject)
    return wanted


def _site_packages() -> tuple[Path | None, list[str]]:
    """The folder ``make setup`` installs ``lightning`` into (tests put it on ``PYTHONPATH``) and what goes there."""
    makefile = (REPO / "Makefile").read_text()
    folder = _make_variable(makefile, "LIGHTNING_SITE")
    site = Path(folder[0].replace("$(VENV)", sys.prefix)) if folder else None
    return site, [_name(r) for r in _make_variable(makefile, "LIGHTNING_SITE_PACKAGES")]


def missing() -> dict[str, str]:
    """The distributions of :func:`required` that are not installed in this interpreter -> who asks for them."""
    absent = {}
    for name, source in required().items():
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent[name] = source
    site, names = _site_packages()
    if site is not None:
        there = {_normal(d.metadata["Name"]) for d in importlib.metadata.distributions(path=[str(site)])}
        absent.update({name: f"Makefile (LIGHTNING_SITE: {site})" for name in names if _normal(name) not in there})
    return absent


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def report(absent: dict[str, str]) -> str:
    listed = ", ".join(f"{name} ({source})" for name, source in sorted(absent.items()))
    return (
        f"{sys.prefix} is the venv `make setup` made, but {len(absent)} distribution(s) it installs are missing:"
        f" {listed}. Their tests would skip instead of testing them. Run `rm {sys.prefix}/.installed && make setup`"
        " (or pip install them) before `make test`."
    )


def strict_importorskip(modname: str, minversion: str | None = None, reason: str | None = None, **kwargs: Any) -> Any:
    """``pytest.importorskip`` for `make setup`'s venv: the module is imported, and a failure is an error."""
    try:
        module = importlib.import_module(modname)
    except ImportError as err:
        raise ImportError(
            f"`pytest.importorskip({modname!r})` in the venv `make setup` made: {modname!r} cannot be imported"
            f" ({type(err).__name__}: {err}). `make setup` installs it; a broken install must fail the run, not skip"
            f" its tests{f' ({reason})' if reason else ''}."
        ) from err
    if minversion is not None:
        from packaging.version import Version

        version = getattr(module, "__version__", None)
        if version is None or Version(version) < Version(minversion):
            raise ImportError(f"{modname!r} has version {version!r}, the tests need {minversion!r}.")
    return module
