"""The core's own plugin (``fabric_core.plugins.builtin``): its default decisions, and the names it reserves for this
project's other distributions, which must be exactly the names those distributions register."""

from __future__ import annotations

import fnmatch
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from plugin_doubles import RecordingStrategy

from fabric_core import Fabric
from fabric_core.environments.plain import PlainEnvironment
from fabric_core.plugins import build_registry
from fabric_core.plugins.builtin import FIRST_PARTY
from fabric_core.plugins.kinds import KINDS
from fabric_core.plugins.registry import normalise_distribution


def test_auto_strategy_without_a_parallel_plugin_names_the_distribution(use_registry, install_hint):
    use_registry()
    with pytest.raises(ValueError, match=install_hint("fabric-ddp")):
        Fabric(accelerator="cpu", devices=2)


def test_default_environment_detection_without_plugins(use_registry):
    use_registry()
    env = Fabric(accelerator="cpu", strategy=RecordingStrategy()).strategy.cluster_environment
    assert type(env) is PlainEnvironment


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def full_registry():
    """A registry with every installed distribution loaded (autoload on, nothing blocked)."""
    mp = pytest.MonkeyPatch()
    for variable in ("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "FABRIC_PLUGINS", "FABRIC_DISABLE_PLUGINS"):
        mp.delenv(variable, raising=False)
    try:
        yield build_registry()
    finally:
        mp.undo()


@pytest.mark.parametrize("dist", sorted(FIRST_PARTY))
def test_first_party_reserved_names_are_what_the_distribution_registers(dist, full_registry):
    """A name reserved for a first-party distribution that it does not register would say "pip install X" for a
    name X lacks; a name it registers without reserving it could be taken by a third party while X is absent."""
    if not _installed(dist):
        pytest.skip(f"{dist} is not installed in this environment (the XLA lane installs only some distributions)")
    assert not [f for f in full_registry.failures if normalise_distribution(f.distribution) == dist]
    for kind in KINDS:
        reserved = FIRST_PARTY[dist].get(kind, ())
        exact = {n for n in reserved if not any(c in n for c in "*?[")}
        patterns = [n for n in reserved if n not in exact]
        entries = [e for e in full_registry.entries(kind) if normalise_distribution(e.distribution) == dist]
        registered = {e.name for e in entries} | {alias for e in entries for alias in e.alias_warnings}
        assert registered == exact, f"{dist} {kind}: registered {sorted(registered)}, reserved {sorted(exact)}"
        for pattern in patterns:
            assert any(fnmatch.fnmatchcase(n, pattern) for n in registered), f"{dist}: {pattern!r} matches nothing"
