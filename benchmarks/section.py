"""What a benchmark section declares, and where the harness finds the sections.

A section is one module in ``benchmarks/sections/`` that defines ``SECTION = Section(...)``: its name, its
settings for each mode, its targets, the function that measures and the function that renders its part of
``docs/benchmarks.md``. The harness (``python -m benchmarks``) discovers the modules of that folder, so adding
a section touches that one file (plus a worker script when it starts processes of its own).

Nothing here imports torch: the harness process reads every section's declaration without importing it, so its
own state cannot influence what the measuring processes see. A section module imports torch inside its
functions only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import LIGHTNING, OURS

#: The modes every section is asked about. ``full``: the published numbers; ``quick``: a run under a few
#: minutes; ``tiny``: a few iterations of everything, for the harness's smoke tests (its numbers mean nothing).
MODES = ("full", "quick", "tiny")


@dataclass(frozen=True)
class Target:
    """One performance promise: a ratio the section measures, its bound, and what sits beside it.

    ``path`` leads, inside the section's result, to a dict of summaries (``_common.summarize``) keyed by variant;
    the target judges ``variant``'s median against ``bound`` and shows ``comparator``'s entry of the same dict
    (lightning-fabric's, by default) beside it.
    """

    id: str
    label: str
    path: tuple[str, ...]
    op: str
    bound: float
    variant: str = OURS
    comparator: str | None = LIGHTNING

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"target {self.id!r}: op must be '<=' or '>=', got {self.op!r}")


@dataclass(frozen=True)
class RunContext:
    """What a section's ``run`` receives."""

    #: ``full``, ``quick`` or ``tiny``.
    mode: str
    #: This section's settings for the mode (``Section.modes[mode]``).
    config: Mapping[str, Any]
    #: The variants to compare: ``raw`` and ``ours``, plus ``lightning`` when it is installed and wanted.
    variants: tuple[str, ...]
    #: Harness-wide options: ``threads``, ``clock``, ``ckpt_dir`` (see ``python -m benchmarks --help``).
    options: Mapping[str, Any]
    log: Callable[[str], None] = print

    @property
    def lightning(self) -> bool:
        return LIGHTNING in self.variants


@dataclass(frozen=True)
class RenderContext:
    """What a section's ``render`` receives besides its own result."""

    mode: str
    #: Whether lightning-fabric took part in this run (its columns stay out otherwise).
    lightning: bool


@dataclass(frozen=True)
class Section:
    """A benchmark section: see the module docstring and docs/benchmarks.md ("Adding a section")."""

    #: The key in ``--sections``, in ``results["sections"]`` and in the smoke tests.
    name: str
    #: Per mode, the settings handed to ``run`` (``RunContext.config``), or a string: why it does not run in
    #: that mode. A mode left out is not run, with a generic reason.
    modes: Mapping[str, Mapping[str, Any] | str]
    #: Measures and returns the section's result: a JSON-serialisable dict (``status`` is added when missing).
    run: Callable[[RunContext], dict[str, Any]]
    #: Returns this section's Markdown (a ``###`` heading, tables, a few sentences) from its result.
    render: Callable[[dict[str, Any], RenderContext], str]
    targets: tuple[Target, ...] = ()
    #: Where it goes in the run and in the report: lower first, then by name.
    order: int = 100
    #: Run ``run`` in a fresh interpreter (``python -m benchmarks --child NAME``): for sections that import torch
    #: or the libraries they compare in their own process.
    isolated: bool = False
    #: Why the section cannot run on this machine (a plugin or package missing), or ``None``; checked before ``run``.
    unavailable: Callable[[], str | None] = field(default=lambda: None)
    #: Whether lightning-fabric takes part when installed; a mode's ``"lightning": False`` setting leaves it out there.
    compares_lightning: bool = True
    #: Wall-clock limit for an isolated section's process.
    timeout_s: float = 3600

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(
                f"section {self.name!r}: unknown mode(s) {sorted(unknown)}; the modes are {MODES}"
            )

    def mode_config(self, mode: str) -> Mapping[str, Any] | str:
        """The mode's settings, or why the section is not run in it."""
        return self.modes.get(mode, f"not run in --{mode} mode")


PACKAGE = "benchmarks.sections"


def discover() -> list[Section]:
    """Every ``SECTION`` of the modules in ``benchmarks/sections/`` (names starting with ``_`` are helpers)."""
    package = importlib.import_module(PACKAGE)
    found: dict[str, Section] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        section = getattr(module, "SECTION", None)
        if not isinstance(section, Section):
            raise TypeError(f"{PACKAGE}.{info.name} defines no `SECTION = Section(...)`")
        if section.name in found:
            raise ValueError(f"two modules declare the section {section.name!r}")
        found[section.name] = section
    return sorted(found.values(), key=lambda s: (s.order, s.name))


def by_name(name: str) -> Section:
    for section in discover():
        if section.name == name:
            return section
    raise KeyError(name)
