"""Names: what every accelerator, strategy, precision, launcher and cluster environment is called, and who provides it.

One :class:`Registry` holds every name. It is filled by the registration hooks of every plugin, in the load order
of :mod:`fabric_core.plugins.discovery` (which finds and loads the plugins, and gives the registry the
:class:`~fabric_core.plugins.decisions.Decisions` that ask its decision hooks). This module is the plugin host's
data: of the host it imports only :mod:`~fabric_core.plugins.kinds`.

Rules (also in ``docs/plugins.md``):

* **Lazy**: registering stores *import strings*, so listing names never imports the module behind them; the
  target is imported the first time its name is resolved.
* **Hints**: a registration can say that a name (or an ``fnmatch`` pattern such as ``name_*``) is provided by a
  distribution that may not be installed (:meth:`Registrar.provided_by`); resolving it then says which
  ``pip install`` adds it. The distributions the core names this way are this project's *first-party* plugins.
* **One precedence rule**: earlier in the load order wins, for names and for decisions. The load order is the
  core, then first-party distributions, then all others, each group alphabetically by distribution name. A
  later registration of a taken name is ignored with a :class:`FabricPluginWarning`, unless it passes
  ``override=True``; then it wins, with the same warning. A name the core names as a first-party distribution's
  (exactly, not by a pattern) counts as taken by it even while that distribution is not installed.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pluggy

    from fabric_core.plugins.decisions import Decisions

from fabric_core.plugins.kinds import KINDS
from fabric_core.utilities.exceptions import guarded

ENTRY_POINT_GROUP = "fabric.plugins"
CORE_DISTRIBUTION = "fabric-core"


class FabricPluginWarning(UserWarning):
    """Something about the installed plugins deserves attention (a conflict, a broken plugin)."""


class PluginImportError(ImportError):
    """The module behind a registered name could not be imported."""


class PluginFailure(NamedTuple):
    """A plugin, or one of its hook implementations, that failed; kept so ``fabric plugins`` and errors report it.

    ``stage`` says where: ``"import"`` (its registration module), ``"validation"`` (a hook pluggy does not
    know, or bad arguments), ``"registration"`` (a registration hook raised), or ``"hook <name>"`` (a decision
    hook raised; that implementation was skipped).
    """

    plugin: str
    distribution: str
    version: str | None
    error: BaseException
    stage: str = "import"

    def describe(self) -> str:
        version = f" {self.version}" if self.version else ""
        return f"{self.distribution}{version} (plugin {self.plugin!r}, {self.stage}): {type(self.error).__name__}: {self.error}"


class PluginInfo(NamedTuple):
    """One loaded plugin: who provides it and where it stands in the load order."""

    name: str
    distribution: str
    version: str | None
    position: int
    first_party: bool = False
    #: top-level package of the plugin's code; decisions about objects from this package belong to the plugin
    package: str = ""
    #: modules its registration module imported that registration modules should not (see ``fabric plugins --check``)
    heavy_imports: tuple[str, ...] = ()


@dataclass
class Entry:
    """One registered name."""

    kind: str
    name: str
    target: type | str
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    distribution: str = CORE_DISTRIBUTION
    version: str | None = None
    alias_warnings: dict[str, str | None] = field(default_factory=dict)
    #: environments only: the variables one of which must be set for ``detect()`` to be asked (``None``: always asked)
    detected_by: tuple[str, ...] | None = None
    #: checkpoint formats only: a cheap ``location -> bool`` (or its import string) asked before the format's module
    #: is imported (``None``: the format itself is built and asked)
    recognised_by: Callable[[Any], bool] | str | None = None
    _loaded: type | None = field(default=None, repr=False)

    def may_detect(self, environ: Mapping[str, str]) -> bool:
        """Whether automatic detection has to import this environment: one of ``detected_by`` is set in ``environ``."""
        return self.detected_by is None or any(variable in environ for variable in self.detected_by)

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
        self._loaded = _import_target(self.target, self)
        return self._loaded

    def create(self, *args: Any, **overrides: Any) -> Any:
        cls = self.load()
        return cls(*args, **{**self.init_kwargs, **overrides})

    def may_recognise(self, location: Any) -> bool:
        """Checkpoint formats: whether ``recognised_by`` lets the format at ``location`` be imported and asked."""
        check = self.recognised_by
        if check is None:
            return True
        if isinstance(check, str):
            check = self.recognised_by = _import_target(check, self)
        return bool(check(location))


def _import_object(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _import_target(target: str, entry: Entry) -> Any:
    """The object an import string ``"package.module:attr"`` of ``entry`` names; a failure (a plugin's module may
    raise anything as it is imported) is a :class:`PluginImportError` naming the distribution."""
    obj, err = guarded(_import_object, target)
    if err is not None:
        version = f" {entry.version}" if entry.version else ""
        raise PluginImportError(
            f"The {entry.kind} {entry.name!r} is provided by {entry.distribution}{version}, but importing"
            f" {target!r} failed: {type(err).__name__}: {err}. Reinstall or upgrade"
            f" `{entry.distribution}`, or pick another {entry.kind}."
        ) from err
    return obj


class NameHint(NamedTuple):
    """``pattern`` (a name, or an ``fnmatch`` pattern) of ``kind`` is provided by ``distribution``."""

    kind: str
    pattern: str
    distribution: str
    declared_by: str

    @property
    def is_pattern(self) -> bool:
        return any(c in self.pattern for c in "*?[")

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)


class Conflict(NamedTuple):
    """A registration that lost: ``loser`` was ignored (or replaced) in favour of ``winner``'s distribution."""

    kind: str
    name: str
    loser: str
    winner: str
    reason: str


class Registrar:
    """What a registration hook receives: ``add()`` names for one kind on behalf of one plugin."""

    def __init__(self, registry: Registry, kind: str, plugin: PluginInfo) -> None:
        self._registry = registry
        self._plugin = plugin
        self.kind = kind
        self.distribution = plugin.distribution
        self.version = plugin.version
        self.added: list[str] = []

    def add(
        self,
        name: str,
        target: type | str,
        /,
        *,
        description: str = "",
        aliases: dict[str, str | None] | None = None,
        override: bool = False,
        detected_by: Iterable[str] | None = None,
        recognised_by: Callable[[Any], bool] | str | None = None,
        **init_kwargs: Any,
    ) -> None:
        """Register ``name`` (case-insensitive) for ``target`` built with ``init_kwargs``.

        ``name`` and ``target`` are positional-only, so ``init_kwargs`` may use those words too (a logger's ``name=``).
        ``detected_by`` (cluster environments only): environment variables one of which is always set where the
        environment's ``detect()`` can be true; where none is, automatic detection skips it without importing it
        (``()``: an explicit-only environment, never imported for detection; ``None``: always imported and asked).
        ``recognised_by`` (checkpoint formats only): a cheap function ``location -> bool``, or its import string,
        asked before the format's module is imported when a checkpoint's format is looked up (``None``: the format
        is built and its ``recognises`` asked).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if not isinstance(target, (type, str)):
            raise TypeError(
                f"The target registered for {self.kind} {name!r} must be a class or an import string"
                f" 'package.module:Class', got {type(target).__name__}."
            )
        if detected_by is not None and self.kind != "environment":
            raise TypeError(f"`detected_by` is for cluster environments; {self.kind} {name!r} cannot take it.")
        if recognised_by is not None and self.kind != "checkpoint_format":
            raise TypeError(f"`recognised_by` is for checkpoint formats; {self.kind} {name!r} cannot take it.")
        if recognised_by is not None and not (callable(recognised_by) or isinstance(recognised_by, str)):
            raise TypeError(
                f"`recognised_by` of checkpoint format {name!r} must be a function `location -> bool` or an import"
                f" string 'package.module:function', got {type(recognised_by).__name__}."
            )
        if isinstance(detected_by, str):
            raise TypeError(f"`detected_by` of environment {name!r} takes variable names, e.g. ({detected_by!r},).")
        entry = Entry(
            kind=self.kind,
            name=name.lower(),
            target=target,
            init_kwargs=dict(init_kwargs),
            description=description,
            distribution=self.distribution,
            version=self.version,
            alias_warnings={str(k).lower(): v for k, v in (aliases or {}).items()},
            detected_by=None if detected_by is None else tuple(detected_by),
            recognised_by=recognised_by,
        )
        if self._registry._add(entry, override=override):
            self.added.append(entry.name)

    def provided_by(self, distribution: str, *names: str) -> None:
        """Say that ``names`` (exact names or ``fnmatch`` patterns such as ``"mything_*"``) come from ``distribution``.

        Nothing is registered: when such a name is asked for and nothing provides it, the error says how to get
        it (``pip install``, or why the installed distribution did not load). Names the core declares this way
        are reserved for that first-party distribution (see the module docstring).
        """
        for pattern in names:
            if not isinstance(pattern, str) or not pattern:
                raise TypeError(f"A {self.kind} name or pattern must be a non-empty string, got {pattern!r}.")
            self._registry._hints.append(NameHint(self.kind, pattern.lower(), distribution, self.distribution))


class Registry:
    """All names of all kinds, the hints about missing ones, and the plugins that produced them."""

    def __init__(self, plugin_manager: pluggy.PluginManager) -> None:
        self.plugin_manager = plugin_manager
        #: loaded plugins by pluggy name, in load order
        self.plugins: dict[str, PluginInfo] = {}
        self.failures: list[PluginFailure] = []
        #: distributions whose entry points were not loaded because autoloading is switched off.
        self.skipped: list[str] = []
        #: distributions whose entry points were not loaded because FABRIC_DISABLE_PLUGINS names them.
        self.blocked: list[str] = []
        #: ``(variable, name)``: a name FABRIC_PLUGINS or FABRIC_DISABLE_PLUGINS gives that no installed plugin has.
        self.unknown_names: list[tuple[str, str]] = []
        self.conflicts: list[Conflict] = []
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._aliases: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        self._hints: list[NameHint] = []
        #: The decision hooks, called with this registry's precedence, failure isolation and tracing (given by
        #: :func:`~fabric_core.plugins.discovery.build_registry`, which builds every registry).
        self.decisions: Decisions

    # ----------------------------------------------------------------------------------------------- writing
    def _add(self, entry: Entry, override: bool) -> bool:
        """Store ``entry`` by the precedence rule; returns whether it was stored."""
        table = self._entries[entry.kind]
        for name in [entry.name, *entry.alias_warnings]:
            reserved = self._reserved_for(entry.kind, name)
            if (
                reserved is not None
                and normalise_distribution(reserved) != normalise_distribution(entry.distribution)
                and self.lookup(entry.kind, name) is None
            ):
                if not override:
                    self._conflict(entry, name, reserved, f"it is reserved for {reserved}; pass override=True to take it")
                    return False
                self._conflict_replaced(entry, name, reserved)
            existing = self.lookup(entry.kind, name)
            if existing is None:
                continue
            if not override:
                self._conflict(entry, name, existing.distribution, "first registration wins")
                return False
            self._conflict_replaced(entry, name, existing.distribution)
            table.pop(existing.name, None)
            for alias, target in list(self._aliases[entry.kind].items()):
                if target == existing.name:
                    del self._aliases[entry.kind][alias]
        table[entry.name] = entry
        for alias in entry.alias_warnings:
            self._aliases[entry.kind][alias] = entry.name
        return True

    def _conflict(self, entry: Entry, name: str, kept: str, reason: str) -> None:
        self.conflicts.append(Conflict(entry.kind, name, entry.distribution, kept, reason))
        warnings.warn(
            f"The {entry.kind} name {name!r} registered by {entry.distribution} is ignored: {kept} has it ({reason})."
            " Uninstall one of them to silence this warning.",
            FabricPluginWarning,
            stacklevel=4,
        )

    def _conflict_replaced(self, entry: Entry, name: str, previous: str) -> None:
        self.conflicts.append(Conflict(entry.kind, name, previous, entry.distribution, "override=True"))
        warnings.warn(
            f"The {entry.kind} name {name!r} of {previous} is replaced by {entry.distribution}, which registered it"
            " with override=True. Uninstall one of them to silence this warning.",
            FabricPluginWarning,
            stacklevel=4,
        )

    def record_failure(self, failure: PluginFailure, message: str) -> None:
        """Keep ``failure`` for reports and warn with ``message``; a failure already recorded is not repeated."""
        key = (failure.plugin, failure.stage, type(failure.error), str(failure.error))
        if any((f.plugin, f.stage, type(f.error), str(f.error)) == key for f in self.failures):
            return
        self.failures.append(failure)
        warnings.warn(f"{message}: {failure.describe()}", FabricPluginWarning, stacklevel=3)

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
        return self.lookup(kind, str(name).lower()) is not None

    def lookup(self, kind: str, name: str) -> Entry | None:
        """The entry registered for ``name`` (or an alias of it), or ``None``."""
        table = self._entries[kind]
        key = str(name).lower()
        if key in table:
            return table[key]
        canonical = self._aliases[kind].get(key)
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
        entry = self.lookup(kind, name)
        if entry is not None:
            return entry
        raise ValueError(self.unknown_name_message(kind, name))

    def create(self, kind: str, name: str, /, *args: Any, **overrides: Any) -> Any:
        """Build the object registered as ``name`` (``kind``/``name`` positional-only: ``overrides`` may hold a ``name``)."""
        return self.get(kind, name).create(*args, **overrides)

    def registered_formats(self) -> tuple[Any, ...]:
        """Every registered checkpoint format in the load order, as the strategies ask them
        (:class:`~fabric_core.io.registered.RegisteredFormat`: a format's module is imported only when its
        ``recognised_by``, if any, says a location is one of its)."""
        from fabric_core.io.registered import RegisteredFormat

        entries = self._entries["checkpoint_format"].values()  # registration order: the load order
        return tuple(RegisteredFormat(entry.name, entry.may_recognise, entry.create) for entry in entries)

    # ----------------------------------------------------------------------------------------------- hints
    @property
    def hints(self) -> list[NameHint]:
        return list(self._hints)

    @property
    def first_party_distributions(self) -> set[str]:
        """The distributions the core itself names as providers: this project's own plugins."""
        return {normalise_distribution(h.distribution) for h in self._hints if h.declared_by == CORE_DISTRIBUTION}

    def _reserved_for(self, kind: str, name: str) -> str | None:
        """The first-party distribution an exact hint of the core reserves ``name`` for (patterns only hint)."""
        for hint in self._hints:
            if hint.kind == kind and hint.declared_by == CORE_DISTRIBUTION and not hint.is_pattern and hint.pattern == name:
                return hint.distribution
        return None

    def distribution_for(self, kind: str, name: Any) -> str | None:
        """The distribution a hint names as the provider of ``name``, or ``None``."""
        key = str(name).lower()
        for hint in self._hints:
            if hint.kind == kind and hint.matches(key):
                return hint.distribution
        return None

    def hinted_distributions(self, kind: str) -> dict[str, list[str]]:
        """Distributions hinted for ``kind`` that provide none of its registered names -> the names they would add."""
        installed = {normalise_distribution(e.distribution) for e in self._entries[kind].values()}
        out: dict[str, list[str]] = {}
        for hint in self._hints:
            if hint.kind == kind and normalise_distribution(hint.distribution) not in installed:
                out.setdefault(hint.distribution, []).append(hint.pattern)
        return out

    def install_hint(self, dist: str) -> str:
        """Why ``dist``'s names are missing and what to do: failed to load, switched off, or absent."""
        failures = [f for f in self.failures if normalise_distribution(f.distribution) == normalise_distribution(dist)]
        if failures:
            return f"It is provided by `{dist}`, which is installed but failed to load: {failures[0].describe()}"
        if any(normalise_distribution(s) == normalise_distribution(dist) for s in self.blocked):
            return (
                f"It is provided by `{dist}`, which is installed but was not loaded because FABRIC_DISABLE_PLUGINS"
                " names it: remove it from that variable."
            )
        if any(normalise_distribution(s) == normalise_distribution(dist) for s in self.skipped):
            return (
                f"It is provided by `{dist}`, which is installed but was not loaded because"
                f" FABRIC_DISABLE_PLUGIN_AUTOLOAD=1: add it with FABRIC_PLUGINS={dist}."
            )
        return f"It is provided by a separate distribution: run `pip install {dist}`."

    def unknown_name_message(self, kind: str, name: Any, special: tuple[str, ...] = ()) -> str:
        """"You selected an invalid <kind> name", every name (``special`` ones, such as ``"auto"``, first), then
        the closest name and the plugins that failed to load."""
        key = str(name).lower()
        available = self.all_names(kind)
        message = f"You selected an invalid {kind} name: `{kind}={name!r}`."
        dist = self.distribution_for(kind, name)
        if dist is not None:
            return f"{message} {self.install_hint(dist)}"
        message += f" Available names are: {', '.join([*special, *available]) or '(none)'}."
        # Names of distributions that are not installed count as candidates too: "wnadb" -> "wandb" + how to get it.
        hinted = sorted({h.pattern for h in self._hints if h.kind == kind and not h.is_pattern} - set(available))
        close = difflib.get_close_matches(key, [*special, *available, *hinted], n=1, cutoff=0.5)
        if close:
            message += f" Did you mean {close[0]!r}?"
            if close[0] in hinted:
                message += f" {self.install_hint(self.distribution_for(kind, close[0]))}"
        if self.failures:
            message += " Some plugins failed to load: " + "; ".join(f.describe() for f in self.failures) + "."
        return message

    # ----------------------------------------------------------------------------------------------- hooks
    @property
    def hook(self) -> Any:
        """pluggy's raw hook relay (no precedence rule, no isolation): prefer :attr:`decisions`."""
        return self.plugin_manager.hook

    def plugin_for(self, plugin_name: str) -> PluginInfo:
        return self.plugins.get(plugin_name) or PluginInfo(plugin_name, plugin_name, None, len(self.plugins))


def normalise_distribution(name: str) -> str:
    """Distribution names compare case-insensitively with ``-``, ``_`` and ``.`` equivalent (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()
