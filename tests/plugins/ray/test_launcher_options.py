"""``--ray-env`` (or ``FABRIC_RAY_ENV``): which of the driver's variables every process of a ``--launcher ray`` job
gets. A Ray worker inherits its node's Ray environment, not the driver's, so a key exported before ``fabric run`` is
there only when forwarded. (The cluster test in ``test_ray_launcher.py`` checks that the forwarded values arrive.)"""

from __future__ import annotations

import pytest
from fabric_ray.launcher import LaunchError, forwarded_environment

DRIVER = {"WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "HF_TOKEN": "t", "RANK": "7", "PATH": "/bin"}


def test_names_values_and_patterns_are_forwarded() -> None:
    found = forwarded_environment("HF_TOKEN, WANDB_*,SEED=3,EMPTY=", DRIVER)
    assert found == {"HF_TOKEN": "t", "WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "SEED": "3", "EMPTY": ""}
    assert forwarded_environment(None, DRIVER) == {} and forwarded_environment(" , ", DRIVER) == {}
    assert forwarded_environment("NOTHING_*", DRIVER) == {}, "a pattern that matches nothing forwards nothing"
    assert "RANK" not in forwarded_environment("*", DRIVER), "a pattern never carries the launcher's own variables"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("MISSING_KEY", "names MISSING_KEY, which is not set here"),
        ("RANK", "RANK is set by the launcher for each process"),
        ("MASTER_PORT=1", "MASTER_PORT is set by the launcher"),
        ("1BAD", "'1BAD' is not NAME, NAME=VALUE or a pattern"),
        ("A B=1", "'A B=1' is not NAME"),
    ],
)
def test_bad_specs_are_refused_with_what_to_do(spec: str, words: str) -> None:
    with pytest.raises(LaunchError, match="--ray-env") as caught:
        forwarded_environment(spec, DRIVER)
    assert words in str(caught.value)
