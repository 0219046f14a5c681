"""Plugin discovery and name resolution.

One :class:`Registry` holds every name that accelerators, strategies, precisions, launchers and cluster
environments are known by. It is filled by calling the registration hooks of every plugin: first the core's
built-ins (:mod:`fabric_core.builtin`), then the modules named by the ``fabric.plugins`` entry points of the
installed distributions, in alphabetical order of distribution name.

Rules (also in ``docs/plugins.md``):

* **Lazy**: an entry point names a small registration module; registering stores *import strings*, so
  ``fabric plugins`` lists everything without importing deepspeed, torch_xla and friends. The target is
  imported the first time its name is resolved.
* **Isolated failures**: a plugin whose registration module or target fails to import is recorded with its
  distribution name, version and error; only names that need it fail, everything else keeps working.
* **Conflicts**: when two plugins register the same name, the first registration wins (built-ins first, then
  distributions alphabetically) and a :class:`FabricPluginWarning` names both. A plugin that really means to
  replace a name passes ``override=True``; the later registration then wins, with the same warning.
* **Switching off**: ``FABRIC_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry points except those listed in
  ``FABRIC_PLUGINS`` (comma-separated entry-point or distribution names). ``FABRIC_TRACE_HOOKS=1`` prints
  every hook call.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from fabric_core import hookspecs

ENTRY_POINT_GROUP = "fabric.plugins"
KINDS = ("accelerator", "strategy", "precision", "launcher", "environment")
CORE_PROVIDER = ("fabric-core", None)

# Names that belong to distributions of this project, so a missing one gets a `pip install` hint.
KNOWN_DISTRIBUTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "fabric-ddp": {
        "strategy": (
            "ddp",
            "ddp_spawn",
            "ddp_fork",
            "ddp_notebook",
            "ddp_find_unused_parameters_true",
            "ddp_find_unused_parameters_false",
            "dp",
        )
    },
    "fabric-fsdp": {"strategy": ("fsdp", "fsdp_cpu_offload", "fsdp_hybrid", "fsdp_no_reshard")},
    "fabric-deepspeed": {
        "strategy": (
            "deepspeed",
            "deepspeed_stage_1",
            "deepspeed_stage_1_offload",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
            "deepspeed_stage_3_offload_nvme",
        )
    },
    "fabric-xla": {"strategy": ("xla", "xla_fsdp", "single_xla"), "accelerator": ("tpu", "xla")},
    "fabric-amp": {"precision": ("16-mixed", "bf16-mixed", "16", "bf16")},
}


class FabricPluginWarning(UserWarning):
    """Something about the installed plugins deserves attention (a conflict, a broken plugin)."""


class PluginImportError(ImportError):
    """The module behind a registered name could not be imported."""


@dataclass
class PluginFailure:
    """A plugin that could not be loaded; kept so ``fabric plugins`` and errors can report it."""

    plugin: str
    distribution: str
    version: str | None
    error: BaseException

    def describe(self) -> str:
        version = f" {self.version}" if self.version else ""
        return f"{self.distribution}{version} (plugin {self.plugin!r}): {type(self.error).__name__}: {self.error}"


@dataclass
class Entry:
    """One registered name."""

    kind: str
    name: str
    target: type | str
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    distribution: str = "fabric-core"
    version: str | None = None
    alias_warnings: dict[str, str | None] = field(default_factory=dict)
    _loaded: type | None = field(default=None, repr=False)

    @property
    def is_loaded(self) -> bool:
        return self._loaded is not None or not isinstance(self.target, str)

    def load(self) -> type:
        """Import (once) and return the class behind this name."""
        if self._loaded is not None:
            return self._loaded
        if not isinstance(self.target, str):
            self._loaded = self.target
            return self._loaded
        module_name, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as err:
            version = f" {self.version}" if self.version else ""
            raise PluginImportError(
                f"The {self.kind} {self.name!r} is provided by {self.distribution}{version}, but importing"
                f" {self.target!r} failed: {type(err).__name__}: {err}. Reinstall or upgrade"
                f" `{self.distribution}`, or pick another {self.kind}."
            ) from err
        self._loaded = obj
        return obj

    def create(self, *args: Any, **overrides: Any) -> Any:
        cls = self.load()
        return cls(*args, **{**self.init_kwargs, **overrides})


class Registrar:
    """What a registration hook receives: ``add()`` names for one kind on behalf of one plugin."""

    def __init__(self, registry: Registry, kind: str, distribution: str, version: str | None) -> None:
        self._registry = registry
        self.kind = kind
        self.distribution = distribution
        self.version = version

    def add(
        self,
        name: str,
        target: type | str,
        *,
        description: str = "",
        aliases: dict[str, str | None] | None = None,
        override: bool = False,
        **init_kwargs: Any,
    ) -> None:
        """Register ``name`` (case-insensitive) for ``target`` built with ``init_kwargs``."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if not isinstance(target, (type, str)):
            raise TypeError(
                f"The target registered for {self.kind} {name!r} must be a class or an import string"
                f" 'package.module:Class', got {type(target).__name__}."
            )
        entry = Entry(
            kind=self.kind,
            name=name.lower(),
            target=target,
            init_kwargs=dict(init_kwargs),
            description=description,
            distribution=self.distribution,
            version=self.version,
            alias_warnings={str(k).lower(): v for k, v in (aliases or {}).items()},
        )
        self._registry._add(entry, override=override)


class Registry:
    """All names of all kinds, plus the plugin manager that produced them."""

    def __init__(self, plugin_manager: pluggy.PluginManager) -> None:
        self.plugin_manager = plugin_manager
        self.failures: list[PluginFailure] = []
        #: distributions whose entry points were not loaded because autoloading is switched off.
        self.skipped: list[str] = []
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._aliases: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        self.shadowed: list[Entry] = []

    # ----------------------------------------------------------------------------------------------- filling
    def _add(self, entry: Entry, override: bool) -> None:
        table = self._entries[entry.kind]
        names = [entry.name, *entry.alias_warnings]
        for name in names:
            existing = self._lookup_entry(entry.kind, name)
            if existing is None:
                continue
            winner, loser = (entry, existing) if override else (existing, entry)
            warnings.warn(
                f"The {entry.kind} name {name!r} is registered by both {existing.distribution} and"
                f" {entry.distribution}; using the one from {winner.distribution}"
                + (" (it registered with override=True)." if override else " (first registration wins).")
                + " Uninstall one of them to silence this warning.",
                FabricPluginWarning,
                stacklevel=2,
            )
            self.shadowed.append(loser)
            if not override:
                return
            table.pop(existing.name, None)
            for alias, target in list(self._aliases[entry.kind].items()):
                if target == existing.name:
                    del self._aliases[entry.kind][alias]
        table[entry.name] = entry
        for alias in entry.alias_warnings:
            self._aliases[entry.kind][alias] = entry.name

    # ----------------------------------------------------------------------------------------------- reading
    def entries(self, kind: str) -> list[Entry]:
        return sorted(self._entries[kind].values(), key=lambda e: e.name)

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def all_names(self, kind: str) -> list[str]:
        """Names including aliases, for error messages."""
        return sorted({*self._entries[kind], *self._aliases[kind]})

    def __contains__(self, item: tuple[str, str]) -> bool:
        kind, name = item
        return self._lookup_entry(kind, str(name).lower()) is not None

    def _lookup_entry(self, kind: str, name: str) -> Entry | None:
        table = self._entries[kind]
        if name in table:
            return table[name]
        canonical = self._aliases[kind].get(name)
        return table.get(canonical) if canonical else None

    def canonical_name(self, kind: str, name: str) -> str:
        """Resolve an alias to its canonical name, emitting the alias's warning if it has one."""
        entry = self.get(kind, name)
        key = str(name).lower()
        if key != entry.name:
            message = entry.alias_warnings.get(key)
            if message:
                warnings.warn(message, UserWarning, stacklevel=3)
        return entry.name

    def get(self, kind: str, name: str) -> Entry:
        """Return the entry for ``name`` or raise a ``ValueError`` that teaches what to do."""
        key = str(name).lower()
        entry = self._lookup_entry(kind, key)
        if entry is not None:
            return entry
        raise ValueError(self.unknown_name_message(kind, name))

    def distribution_for(self, kind: str, name: Any) -> str | None:
        """The distribution of this project that provides ``name``, when it is one of ours."""
        key = str(name).lower()
        for dist, kinds in KNOWN_DISTRIBUTIONS.items():
            if key in kinds.get(kind, ()) or (kind == "strategy" and dist == "fabric-deepspeed" and key.startswith("deepspeed")):
                return dist
        return None

    def install_hint(self, dist: str) -> str:
        """Why ``dist``'s names are missing and what to do: failed to load, skipped by the switch, or absent."""
        failures = [f for f in self.failures if _normalise(f.distribution) == _normalise(dist)]
        if failures:
            return f"It is provided by `{dist}`, which is installed but failed to load: {failures[0].describe()}"
        if any(_normalise(s) == _normalise(dist) for s in self.skipped):
            return (
                f"It is provided by `{dist}`, which is installed but was not loaded because"
                f" FABRIC_DISABLE_PLUGIN_AUTOLOAD=1: add it with FABRIC_PLUGINS={dist}."
            )
        return f"It is provided by a separate distribution: run `pip install {dist}`."

    def unknown_name_message(self, kind: str, name: Any) -> str:
        key = str(name).lower()
        available = self.all_names(kind)
        message = f"You selected an invalid {kind} name: `{kind}={name!r}`."
        dist = self.distribution_for(kind, name)
        if dist is not None:
            return f"{message} {self.install_hint(dist)}"
        close = difflib.get_close_matches(key, available, n=1, cutoff=0.5)
        if close:
            message += f" Did you mean {close[0]!r}?"
        message += f" Available names are: {', '.join(available) or '(none)'}."
        if self.failures:
            message += " Some plugins failed to load: " + "; ".join(f.describe() for f in self.failures) + "."
        return message

    def create(self, kind: str, name: str, *args: Any, **overrides: Any) -> Any:
        return self.get(kind, name).create(*args, **overrides)

    @property
    def hook(self) -> Any:
        return self.plugin_manager.hook


# -------------------------------------------------------------------------------------------------------------
# Building the registry
# -------------------------------------------------------------------------------------------------------------

_REGISTRATION_HOOKS = {
    "accelerator": "fabric_register_accelerators",
    "strategy": "fabric_register_strategies",
    "precision": "fabric_register_precisions",
    "launcher": "fabric_register_launchers",
    "environment": "fabric_register_environments",
}

_lock = threading.RLock()
_registry: Registry | None = None


def _iter_entry_points() -> Iterator[Any]:
    from importlib.metadata import entry_points

    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    # Deterministic order: by distribution name, then entry-point name.
    eps.sort(key=lambda ep: ((ep.dist.name if ep.dist else "") or "", ep.name))
    seen: set[tuple[str, str]] = set()
    for ep in eps:
        key = (ep.name, ep.value)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        yield ep


def _autoload_allowed(ep: Any) -> bool:
    if os.environ.get("FABRIC_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() not in ("1", "true", "yes", "on"):
        return True
    allowed = {_normalise(n) for n in os.environ.get("FABRIC_PLUGINS", "").split(",") if n.strip()}
    dist = _normalise(ep.dist.name if ep.dist else "")
    return _normalise(ep.name) in allowed or dist in allowed


def _normalise(name: str) -> str:
    """Distribution names compare case-insensitively with ``-``, ``_`` and ``.`` equivalent (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def build_registry(extra_plugins: tuple[Any, ...] = ()) -> Registry:
    """Create a fresh plugin manager and registry (the cached one is :func:`get_registry`)."""
    from fabric_core import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if os.environ.get("FABRIC_TRACE_HOOKS", "") == "1":
        pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[fabric hooks] {msg}"))
        pm.enable_tracing()
    registry = Registry(pm)
    providers: dict[int, tuple[str, str | None]] = {}

    pm.register(builtin, name="fabric_core.builtin")
    providers[id(builtin)] = CORE_PROVIDER
    for ep in _iter_entry_points():
        if not _autoload_allowed(ep):
            registry.skipped.append(ep.dist.name if ep.dist else ep.name)
            continue
        dist_name = ep.dist.name if ep.dist else ep.name
        dist_version = ep.dist.version if ep.dist else None
        try:
            plugin = ep.load()
            if pm.is_registered(plugin):
                continue
            pm.register(plugin, name=f"{dist_name}:{ep.name}")
        except Exception as err:
            failure = PluginFailure(ep.name, dist_name, dist_version, err)
            registry.failures.append(failure)
            warnings.warn(
                f"Failed to load the Fabric plugin {failure.describe()}. Other plugins are unaffected;"
                " set FABRIC_DISABLE_PLUGIN_AUTOLOAD=1 to skip entry-point plugins.",
                FabricPluginWarning,
                stacklevel=2,
            )
            continue
        providers[id(plugin)] = (dist_name, dist_version)
    for plugin in extra_plugins:
        pm.register(plugin)
        providers[id(plugin)] = (getattr(plugin, "__name__", type(plugin).__name__), None)

    # Call each plugin's registration hooks separately, so a failing one is isolated and attributed. The order
    # is the documented load order (built-ins, distributions alphabetically, extras), which the conflict rule
    # "first registration wins" relies on; pluggy's own call order is the reverse of registration.
    position = {plugin_id: index for index, plugin_id in enumerate(providers)}
    for kind, hook_name in _REGISTRATION_HOOKS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in sorted(hook.get_hookimpls(), key=lambda impl: position.get(id(impl.plugin), len(position))):
            dist, version = providers.get(id(impl.plugin), (impl.plugin_name, None))
            try:
                impl.function(registrar=Registrar(registry, kind, dist, version))
            except Exception as err:
                failure = PluginFailure(impl.plugin_name, dist, version, err)
                registry.failures.append(failure)
                warnings.warn(
                    f"The Fabric plugin {failure.describe()} failed while registering {kind} names;"
                    " its names are unavailable.",
                    FabricPluginWarning,
                    stacklevel=2,
                )
    return registry


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = build_registry()
    return _registry


def reset_registry() -> None:
    """Forget the cached registry (tests, or after installing a plugin in a running process)."""
    global _registry
    with _lock:
        _registry = None
