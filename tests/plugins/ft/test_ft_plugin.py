"""fabric-ft as a plugin: ``strategy="ft_ddp"`` comes from the installed entry point, and a job that is not set up as
a replica group fails at ``Fabric(...)`` with an error that says what to set (nothing is contacted before the first
``fabric.setup``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from fabric_core import Fabric  # noqa: E402
from fabric_ft import FTDDPStrategy  # noqa: E402

GROUP = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"}


@pytest.fixture
def group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in GROUP.items():
        monkeypatch.setenv(name, value)


def test_ft_ddp_is_the_strategy_of_one_replica_group(group_env: None):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="ft_ddp")
    strategy = fabric.strategy
    assert isinstance(strategy, FTDDPStrategy)
    assert (strategy.lighthouse, strategy.replica_group, strategy.num_replica_groups) == ("http://127.0.0.1:1", 1, 2)
    # The data is split by replica group; group 1 is not the writer before any quorum.
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert not fabric.is_global_zero


@pytest.mark.parametrize("missing", sorted(GROUP))
def test_a_missing_setting_is_named(monkeypatch: pytest.MonkeyPatch, group_env: None, missing: str):
    monkeypatch.delenv(missing)
    with pytest.raises(ValueError, match=f"\\${missing}"):
        Fabric(accelerator="cpu", devices=1, strategy="ft_ddp")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 2}, "one process per replica group, but `devices` selects 2"),
        ({"devices": 1, "num_nodes": 2}, "one job\\s+per machine"),
    ],
)
def test_several_processes_per_group_are_refused(group_env: None, kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        Fabric(accelerator="cpu", strategy="ft_ddp", **kwargs)


@pytest.mark.parametrize(
    ("group", "count", "match"),
    [("2", "2", "between 0 and num_replica_groups - 1"), ("one", "2", "variable `REPLICA_GROUP_ID` must be an integer, got .one.")],
)
def test_a_bad_group_number_is_refused(monkeypatch: pytest.MonkeyPatch, group_env: None, group: str, count: str, match: str):
    monkeypatch.setenv("REPLICA_GROUP_ID", group)
    monkeypatch.setenv("NUM_REPLICA_GROUPS", count)
    with pytest.raises(ValueError, match=match):
        Fabric(accelerator="cpu", devices=1, strategy="ft_ddp")


def test_min_replicas_below_one_is_refused():
    with pytest.raises(ValueError, match="`min_replicas=0` must be at least 1"):
        FTDDPStrategy(min_replicas=0)
