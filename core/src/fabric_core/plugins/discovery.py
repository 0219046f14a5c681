"""Finding and loading plugins: entry points, the switches, validation, and the load order.

:func:`build_registry` creates the pluggy manager, registers the core's own plugin (:mod:`fabric_core.plugins.builtin`)
and runs its registration hooks first, then loads the ``fabric.plugins`` entry points of the installed
distributions (found by :mod:`fabric_core.plugins.entry_points`) in the documented load order (first-party distributions, then the others, each alphabetically),
and finally runs their registration hooks in that order.

Every plugin is checked where it enters, and a bad one is reported naming its distribution and version, never
allowed to break the others:

* its registration module fails to import (also ``sys.exit()`` at import) -> ``stage="import"``;
* it implements a hook that no spec declares (a typo such as ``fabric_register_strategy``), takes arguments
  the spec does not have, or wraps a decision hook -> ``stage="validation"``, and it is unregistered;
* a registration hook raises -> ``stage="registration"``, only its names are missing.

Switches (environment variables, read when the registry is built):

* ``FABRIC_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points except those named in ``FABRIC_PLUGINS``;
* ``FABRIC_PLUGINS=name,...``: the allow-list for the previous switch (entry-point or distribution names);
* ``FABRIC_DISABLE_PLUGINS=name,...``: never load these (entry-point or distribution names);
* ``FABRIC_TRACE_HOOKS=1``: print every registration and decision, and who made it.

A name in ``FABRIC_PLUGINS`` or ``FABRIC_DISABLE_PLUGINS`` that matches no installed plugin is warned about.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
import warnings
from collections.abc import Iterable
from typing import Any

import pluggy

from fabric_core.plugins import builtin, hookspecs
from fabric_core.plugins.decisions import Decisions, trace, tracing_enabled
from fabric_core.plugins.entry_points import dist_of, ordered_entry_points
from fabric_core.plugins.kinds import KINDS
from fabric_core.plugins.registry import (
    CORE_DISTRIBUTION,
    FabricPluginWarning,
    PluginFailure,
    PluginInfo,
    Registrar,
    Registry,
    normalise_distribution,
)
from fabric_core.utilities.exceptions import guarded
from fabric_core.utilities.lazy import name_and_version

AUTOLOAD_VARIABLE = "FABRIC_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_VARIABLE = "FABRIC_PLUGINS"
BLOCK_VARIABLE = "FABRIC_DISABLE_PLUGINS"

#: Packages a registration module must not import (it runs for every ``Fabric()``): ``fabric plugins --check``
#: flags a plugin whose registration module pulled one of them in.
HEAVY_MODULES = (
    "torch", "torch.distributed", "torch._dynamo", "deepspeed", "torch_xla", "jax", "tensorflow", "transformers", "wandb",
    "mlflow",
)  # fmt: skip


def _names(variable: str) -> list[str]:
    return [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def _matches(ep: Any, names: Iterable[str]) -> bool:
    wanted = {normalise_distribution(n) for n in names}
    return normalise_distribution(ep.name) in wanted or normalise_distribution(dist_of(ep)[0]) in wanted


def _heavy_loaded() -> set[str]:
    """The :data:`HEAVY_MODULES` imported so far (a check of ten names, not a copy of ``sys.modules``)."""
    return {name for name in HEAVY_MODULES if name in sys.modules}


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, quicker to register modules: an attribute that cannot be a hook is skipped from the
    module's ``__dict__`` directly. A registration module also holds its imports and constants, and pluggy's
    check of each one (``inspect.getattr_static``) took most of a registration; functions and methods still get
    pluggy's own check, so what counts as a hook is pluggy's rule."""

    _HOOKABLE = (types.FunctionType, types.MethodType, staticmethod, classmethod)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        if isinstance(plugin, types.ModuleType) and not isinstance(vars(plugin).get(name), self._HOOKABLE):
            return None
        return super().parse_hookimpl_opts(plugin, name)

    def parse_hookspec_opts(self, module_or_class: Any, name: str) -> Any:
        if isinstance(module_or_class, types.ModuleType) and not isinstance(
            vars(module_or_class).get(name), self._HOOKABLE
        ):
            return None
        return super().parse_hookspec_opts(module_or_class, name)


def _package_of(plugin: Any) -> str:
    name = plugin.__name__ if isinstance(plugin, type(sys)) else type(plugin).__module__
    return name.split(".")[0]


def validate(pm: pluggy.PluginManager, plugin: Any) -> None:
    """pluggy's ``check_pending`` for one plugin, with a suggestion, plus: decision hooks take no wrappers."""
    for caller in pm.get_hookcallers(plugin) or []:
        if not caller.has_spec():
            if any(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin):
                continue
            close = difflib.get_close_matches(caller.name, hookspecs.HOOK_NAMES, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known hooks: {', '.join(hookspecs.HOOK_NAMES)}."
            raise pluggy.PluginValidationError(plugin, f"it implements {caller.name!r}, which is not a Fabric hook.{hint}")
        if caller.spec is not None and caller.spec.opts.get("firstresult"):
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                    raise pluggy.PluginValidationError(
                        plugin, f"{caller.name!r} is a decision hook: implement it as a plain hookimpl, not a wrapper."
                    )


def build_registry(extra_plugins: tuple[Any, ...] = ()) -> Registry:
    """Create a fresh plugin manager and registry (the process-wide one is :func:`fabric_core.plugins.host.get_registry`)."""
    pm = _PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm)
    registry.decisions = Decisions(registry)
    tracing = tracing_enabled()

    core = PluginInfo("fabric_core.plugins.builtin", CORE_DISTRIBUTION, _core_version(), 0, first_party=True, package="fabric_core")
    pm.register(builtin, name=core.name)
    registry.plugins[core.name] = core
    _run_registration_hooks(registry, [(builtin, core)], tracing)

    first_party = registry.first_party_distributions
    allow, block = _names(ALLOW_VARIABLE), _names(BLOCK_VARIABLE)
    autoload_disabled = _autoload_disabled()
    loaded: list[tuple[Any, PluginInfo]] = []
    seen_eps = []
    for ep in ordered_entry_points(first_party):
        seen_eps.append(ep)
        dist, version = dist_of(ep)
        if _matches(ep, block):
            registry.blocked.append(dist)
            continue
        if autoload_disabled and not _matches(ep, allow):
            registry.skipped.append(dist)
            continue
        loaded_plugin = _load(registry, ep, dist, version)
        if loaded_plugin is None or pm.is_registered(loaded_plugin[0]):
            continue
        plugin, heavy = loaded_plugin
        name = ep.name if pm.get_plugin(ep.name) is None else f"{dist}:{ep.name}"
        info = PluginInfo(
            name,
            dist,
            version,
            len(registry.plugins),
            first_party=normalise_distribution(dist) in first_party,
            package=_package_of(plugin),
            heavy_imports=heavy,
        )
        if _register(registry, plugin, info):
            loaded.append((plugin, info))
    for plugin in extra_plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        if pm.get_plugin(name) is not None:
            name = f"{name}-{id(plugin):x}"
        info = PluginInfo(name, name, None, len(registry.plugins), package=_package_of(plugin))
        if _register(registry, plugin, info):
            loaded.append((plugin, info))

    for variable, names in ((ALLOW_VARIABLE, allow if autoload_disabled else []), (BLOCK_VARIABLE, block)):
        for name in names:
            if not any(_matches(ep, [name]) for ep in seen_eps):
                registry.unknown_names.append((variable, name))  # `fabric plugins` reports it too
                installed = ", ".join(sorted({f"{ep.name} ({dist_of(ep)[0]})" for ep in seen_eps})) or "none"
                warnings.warn(
                    f"{variable} names {name!r}, but no installed Fabric plugin has that entry-point or distribution"
                    f" name. Installed plugins: {installed}.",
                    FabricPluginWarning,
                    stacklevel=3,
                )

    _run_registration_hooks(registry, loaded, tracing)
    return registry


def _load(registry: Registry, ep: Any, dist: str, version: str | None) -> tuple[Any, tuple[str, ...]] | None:
    """Import one entry point's module: ``(plugin, heavy modules it imported)``, or ``None`` if that failed."""
    before = _heavy_loaded()
    try:
        plugin, err = guarded(ep.load)  # a plugin's module may raise anything as it is imported
    except SystemExit as exit_:  # even end the process: it is contained like any other failure
        plugin, err = None, exit_
    if err is not None:
        registry.record_failure(
            PluginFailure(ep.name, dist, version, err, stage="import"),
            "Failed to load a Fabric plugin; other plugins are unaffected (FABRIC_DISABLE_PLUGINS="
            f"{ep.name} switches it off)",
        )
        return None
    return plugin, tuple(sorted(_heavy_loaded() - before))


def _register(registry: Registry, plugin: Any, info: PluginInfo) -> bool:
    pm = registry.plugin_manager
    try:
        pm.register(plugin, name=info.name)
        validate(pm, plugin)
    except (pluggy.PluginValidationError, ValueError) as err:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        registry.record_failure(
            PluginFailure(info.name, info.distribution, info.version, err, stage="validation"),
            "A Fabric plugin was rejected and not loaded",
        )
        return False
    registry.plugins[info.name] = info
    return True


def _run_registration_hooks(registry: Registry, plugins: list[tuple[Any, PluginInfo]], tracing: bool) -> None:
    """Call each plugin's registration hooks separately, in the load order, so a failure is isolated and named."""
    pm = registry.plugin_manager
    for kind, hook_name in KINDS.items():
        impls = {impl.plugin_name: impl for impl in getattr(pm.hook, hook_name).get_hookimpls()}
        for _, info in plugins:
            impl = impls.get(info.name)
            if impl is None:
                continue
            registrar = Registrar(registry, kind, info)
            _, err = guarded(impl.function, **({"registrar": registrar} if "registrar" in impl.argnames else {}))
            if err is not None:
                registry.record_failure(
                    PluginFailure(info.name, info.distribution, info.version, err, stage="registration"),
                    f"A Fabric plugin failed while registering {kind} names; its names are unavailable",
                )
                continue
            if tracing:
                trace(f"{hook_name}: {info.distribution} registered {', '.join(registrar.added) or 'nothing'}")


def _core_version() -> str | None:
    """fabric-core's version, as ``fabric_core.__version__`` reads it (without importing the package face above)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return name_and_version(distribution(CORE_DISTRIBUTION))[1]
    except PackageNotFoundError:  # a source tree on sys.path that is not installed
        return "0+unknown"
