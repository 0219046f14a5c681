"""Registration module of the example plugin, named by the ``fabric.plugins`` entry point.

It must stay cheap: only the hook marker is imported, and targets are import strings, so listing names
never imports :mod:`fabric_example_plugin.strategy` (which imports torch and the core's strategy classes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_core.plugins import hookimpl

if TYPE_CHECKING:
    from fabric_core.plugins import Registrar


@hookimpl
def fabric_register_strategies(registrar: Registrar) -> None:
    registrar.add(
        "example_single",
        "fabric_example_plugin.strategy:StepCountingStrategy",
        description="one device; counts optimizer steps (example plugin)",
        aliases={"example_counting": None},
    )


@hookimpl
def fabric_register_precisions(registrar: Registrar) -> None:
    registrar.add(
        "example-64",
        "fabric_example_plugin.precision:ExampleDoublePrecision",
        description="float64, reported as the example plugin's precision",
        aliases={"example64": "precision='example64' is an old spelling; use precision='example-64'."},
    )
