"""Calling the decision hooks: one typed method per hook, one precedence rule, failures isolated per plugin.

pluggy would call ``firstresult`` implementations last-registered first and stop at the first exception. Here
each implementation is called on its own, in the project's written order, so that:

* **Precedence** matches the rule for names: ``tryfirst`` implementations, then plain ones, then ``trylast``
  ones (the core's defaults); within each group, earlier in the load order first (the core, first-party
  distributions, then others alphabetically). The first answer that is not ``None`` wins.
* **Isolation**: an implementation that raises is reported like a plugin that fails to import (distribution,
  version, error; a :class:`~fabric_core.plugins.registry.FabricPluginWarning` and an entry in ``fabric plugins``) and
  skipped, so the other plugins and the core's defaults still answer. The exception propagates only when the
  decision is the plugin's own business: the core's defaults (nobody else would answer), or a decision about
  a strategy or an accelerator whose class the plugin itself provides (e.g. a sharding plugin refusing a
  precision for its own strategy, an XLA plugin refusing a strategy for its accelerator).
* **Tracing**: ``FABRIC_TRACE_HOOKS=1`` prints every call, its arguments, the answer and who gave it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from fabric_core.plugins.hookspecs import HOOK_NAMES
from fabric_core.plugins.registry import CORE_DISTRIBUTION, PluginFailure
from fabric_core.utilities.exceptions import guarded

if TYPE_CHECKING:
    from fabric_core.accelerators.base import Accelerator
    from fabric_core.environments.base import ClusterEnvironment
    from fabric_core.launchers.base import Launcher
    from fabric_core.plugins.registry import Registry
    from fabric_core.precision.base import Precision
    from fabric_core.strategies.base import Strategy

TRACE_VARIABLE = "FABRIC_TRACE_HOOKS"


def tracing_enabled() -> bool:
    return os.environ.get(TRACE_VARIABLE, "") == "1"


def trace(message: str) -> None:
    sys.stderr.write(f"[fabric hooks] {message}\n")


class Decisions:
    """The decision hooks of one registry, as typed methods."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._order: dict[str, list[Any]] = {}
        self._trace = tracing_enabled()

    # ------------------------------------------------------------------------------------------ the hooks
    def auto_accelerator(self) -> str | None:
        return self.call("fabric_auto_accelerator", registry=self._registry)

    def auto_strategy(
        self, accelerator: Accelerator, num_devices: int, num_nodes: int, interactive: bool
    ) -> str | Strategy | None:
        return self.call(
            "fabric_auto_strategy",
            registry=self._registry,
            accelerator=accelerator,
            num_devices=num_devices,
            num_nodes=num_nodes,
            interactive=interactive,
        )

    def adjust_strategy(self, strategy: str, accelerator: Accelerator, num_devices: int, num_nodes: int) -> str | None:
        return self.call(
            "fabric_adjust_strategy",
            registry=self._registry,
            strategy=strategy,
            accelerator=accelerator,
            num_devices=num_devices,
            num_nodes=num_nodes,
        )

    def select_precision(self, precision: str, strategy: Strategy, accelerator: Accelerator) -> Precision | None:
        return self.call(
            "fabric_select_precision",
            registry=self._registry,
            precision=precision,
            strategy=strategy,
            accelerator=accelerator,
        )

    def detect_cluster_environment(self) -> ClusterEnvironment | None:
        return self.call("fabric_detect_cluster_environment", registry=self._registry)

    def select_launcher(self, strategy: Strategy) -> Launcher | None:
        return self.call("fabric_select_launcher", registry=self._registry, strategy=strategy)

    # ------------------------------------------------------------------------------------------ machinery
    def implementations(self, hook_name: str) -> list[Any]:
        """The implementations of ``hook_name`` in the order they are asked."""
        order = self._order.get(hook_name)
        if order is None:
            impls = getattr(self._registry.plugin_manager.hook, hook_name).get_hookimpls()

            def rank(impl: Any) -> tuple[int, int]:
                group = 0 if impl.tryfirst else 2 if impl.trylast else 1
                return group, self._registry.plugin_for(impl.plugin_name).position

            order = self._order[hook_name] = sorted(impls, key=rank)
        return order

    def hook_names(self) -> list[str]:
        """Every decision hook (``firstresult``) of the hook specifications."""
        pm = self._registry.plugin_manager
        return [
            name
            for name in HOOK_NAMES
            if getattr(pm.hook, name).spec is not None and getattr(pm.hook, name).spec.opts.get("firstresult")
        ]

    def call_one(self, impl: Any, hook_name: str, kwargs: dict[str, Any]) -> Any:
        """One implementation's answer, or ``None`` if it raised (then it is recorded as that plugin's failure)."""
        answer, err = guarded(impl.function, *[kwargs[name] for name in impl.argnames])
        if err is not None:
            self._isolate(impl, hook_name, err)
        return answer

    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """Ask each implementation in turn; return the first answer that is not ``None``."""
        for impl in self.implementations(hook_name):
            answer, err = guarded(impl.function, *[kwargs[name] for name in impl.argnames])  # a plugin's code
            if err is not None:
                if self._owns(impl, kwargs):
                    raise err
                self._isolate(impl, hook_name, err)
                continue
            if answer is not None:
                if self._trace:
                    trace(f"{hook_name}({_describe(kwargs)}) -> {answer!r} (answered by {self._who(impl)})")
                return answer
        if self._trace:
            trace(f"{hook_name}({_describe(kwargs)}) -> None (no plugin answered)")
        return None

    def _who(self, impl: Any) -> str:
        info = self._registry.plugin_for(impl.plugin_name)
        return f"{info.distribution} {info.version}" if info.version else info.distribution

    def _owns(self, impl: Any, kwargs: dict[str, Any]) -> bool:
        info = self._registry.plugin_for(impl.plugin_name)
        if info.distribution == CORE_DISTRIBUTION:
            return True
        if not info.package:
            return False
        # A decision about an object of the plugin's own package: its strategy (a sharding plugin refusing a
        # precision) or its accelerator (an XLA plugin refusing a strategy that cannot run on its devices).
        for obj in (kwargs.get("strategy"), kwargs.get("accelerator")):
            if obj is not None and not isinstance(obj, str) and type(obj).__module__.split(".")[0] == info.package:
                return True
        return False

    def _isolate(self, impl: Any, hook_name: str, err: Exception) -> None:
        info = self._registry.plugin_for(impl.plugin_name)
        failure = PluginFailure(info.name, info.distribution, info.version, err, stage=f"hook {hook_name}")
        self._registry.record_failure(
            failure, f"A Fabric plugin's `{hook_name}` raised; it was skipped and the other plugins answered"
        )
        if self._trace:
            trace(f"{hook_name}: {self._who(impl)} raised {type(err).__name__}: {err} (skipped)")


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "registry")
