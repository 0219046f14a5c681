"""The ``fabric`` command line: ``fabric plugins``, ``fabric run``, ``fabric consolidate``, ``fabric env``,
``fabric ledger``, ``fabric goodput`` (:mod:`fabric_core.cli_goodput`), ``fabric chaos`` (:mod:`fabric_core.cli_chaos`).

Built on argparse so the core needs no CLI dependency. Importing this module is cheap (no torch): ``fabric
--help`` must answer instantly, and ``fabric plugins`` lists every registered name *without* importing the
modules behind them; ``fabric plugins --check`` imports each one, reports whether it can be used here, runs
every plugin's decision hooks once with a CPU probe, and flags registration modules that import heavy modules.

``run`` lives in :mod:`fabric_core.cli_run` (it parses its own line: Fabric's options may follow SCRIPT),
``consolidate`` in :mod:`fabric_core.cli_consolidate`, ``env`` (the bug-report summary) in
:mod:`fabric_core.cli_env` and ``ledger`` (lost and repeated samples of a run) in :mod:`fabric_core.cli_ledger`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.plugins.registry import Entry, Registry

PROG = "fabric"
NOT_CHECKED = "not checked"


def _core_version() -> str | None:
    from fabric_core import __version__

    return __version__


# ------------------------------------------------------------------------------------------------- fabric plugins


def _entry_status(entry: Entry) -> tuple[str, str | None]:
    """Import ``entry``'s target (and, for an accelerator, ask ``is_available()``; for a class with
    ``unavailable_reason()``, ask it): (status, error or the reason it is unavailable)."""
    from fabric_core.plugins.registry import PluginImportError
    from fabric_core.utilities.exceptions import guarded

    try:
        cls = entry.load()
    except PluginImportError as err:  # the registry names every import failure so, the plugin's cause attached
        cause = err.__cause__ or err
        return "error", f"{type(cause).__name__}: {cause}"
    if entry.kind == "accelerator":
        available, err = guarded(cls.is_available)  # a plugin's code
        if err is not None:
            return "error", f"is_available() raised {type(err).__name__}: {err}"
        return ("available" if available else "unavailable"), None
    reason = getattr(cls, "unavailable_reason", None)  # precisions: a package or device this machine lacks
    if callable(reason):
        why, err = guarded(reason)
        if err is not None:
            return "error", f"unavailable_reason() raised {type(err).__name__}: {err}"
        if why:
            return "unavailable", str(why)
    return "available", None


def collect_plugins(
    registry: Registry, check: bool = False, kinds: Sequence[str] | None = None
) -> dict[str, Any]:
    """Everything ``fabric plugins`` shows, as plain data (what ``--json`` prints)."""
    from fabric_core.plugins.kinds import KINDS

    core_version = _core_version()

    def version_of(entry: Entry) -> str | None:
        return entry.version or (core_version if entry.distribution == "fabric-core" else None)

    entries = []
    for kind in kinds or KINDS:
        for entry in registry.entries(kind):
            status, error = _entry_status(entry) if check else (NOT_CHECKED, None)
            reason = error if status == "unavailable" else None  # what is missing here (not an error)
            entries.append(
                {
                    "kind": kind,
                    "name": entry.name,
                    "aliases": sorted(entry.alias_warnings),
                    "distribution": entry.distribution,
                    "version": version_of(entry),
                    "target": entry.target if isinstance(entry.target, str) else _qualname(entry.target),
                    "description": entry.description,
                    "status": status,
                    "error": None if reason else error,
                    "reason": reason,
                }
            )
    conflicts = [
        {"kind": c.kind, "name": c.name, "ignored": c.loser, "used": c.winner, "reason": c.reason}
        for c in registry.conflicts
        if not kinds or c.kind in kinds
    ]
    if check:
        probe_decision_hooks(registry)
    failures = [
        {
            "plugin": failure.plugin,
            "distribution": failure.distribution,
            "version": failure.version,
            "stage": failure.stage,
            "error": f"{type(failure.error).__name__}: {failure.error}",
        }
        for failure in registry.failures
    ]
    return {
        "fabric_core_version": core_version,
        "checked": check,
        "entries": entries,
        "plugins": describe_plugins(registry, check),
        "failures": failures,
        "conflicts": conflicts,
        "not_loaded": sorted(set(registry.skipped)),
        "blocked": sorted(set(registry.blocked)),
        "unknown_names": [{"variable": variable, "name": name} for variable, name in registry.unknown_names],
    }


def _is_decision(caller: Any) -> bool:
    """A decision hook has one answer (``firstresult``); ``fabric_report_packages`` collects every plugin's."""
    return caller.spec is None or bool(caller.spec.opts.get("firstresult"))


def describe_plugins(registry: Registry, check: bool) -> list[dict[str, Any]]:
    """Each loaded plugin: its distribution, the decision hooks it answers, and (with ``check``) heavy imports."""
    from fabric_core.plugins.kinds import KINDS

    pm = registry.plugin_manager
    out = []
    for info in sorted(registry.plugins.values(), key=lambda i: i.position):
        plugin = pm.get_plugin(info.name)
        hooks = sorted(
            caller.name
            for caller in (pm.get_hookcallers(plugin) or [])
            if caller.name not in KINDS.values() and _is_decision(caller)
        ) if plugin is not None else []
        row: dict[str, Any] = {
            "plugin": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "first_party": info.first_party,
            "decision_hooks": hooks,
        }
        if check:
            row["heavy_imports"] = list(info.heavy_imports)
        out.append(row)
    return out


def probe_decision_hooks(registry: Registry) -> None:
    """Call every plugin's decision hooks once with a CPU, single-device probe; failures land in ``registry.failures``.

    A hook that raises during a real ``Fabric()`` is skipped and reported then; this makes ``fabric plugins --check``
    find such a plugin before a run does. Answers are discarded.
    """
    import tempfile
    from pathlib import Path

    from fabric_core.accelerators.cpu import CPUAccelerator
    from fabric_core.strategies.single_device import SingleDeviceStrategy

    accelerator = CPUAccelerator()
    strategy = SingleDeviceStrategy(device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        arguments = {
            "registry": registry,
            "accelerator": accelerator,
            "strategy": strategy,
            "num_devices": 1,
            "num_nodes": 1,
            "interactive": False,
            "precision": "32-true",
            "path": Path(tmp),
        }
        decisions = registry.decisions
        for hook_name in decisions.hook_names():
            impls = [impl for impl in decisions.implementations(hook_name) if registry.plugin_for(impl.plugin_name).distribution != "fabric-core"]
            for impl in impls:
                decisions.call_one(impl, hook_name, {**arguments, "strategy": strategy if hook_name != "fabric_adjust_strategy" else "single_device"})


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def format_table(report: dict[str, Any]) -> str:
    """Render :func:`collect_plugins` output for people."""
    header = ("KIND", "NAME", "ALIASES", "DISTRIBUTION", "VERSION", "STATUS", "DESCRIPTION")
    rows = [
        (
            e["kind"],
            e["name"],
            ",".join(e["aliases"]) or "-",
            e["distribution"],
            e["version"] or "-",
            f"error: {e['error']}" if e["error"] else f"{e['status']}: {e['reason']}" if e.get("reason") else e["status"],
            e["description"],
        )
        for e in report["entries"]
    ]
    # The status column can be long (import errors); keep it last-but-one but never pad it beyond 40 chars.
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    widths[5] = min(widths[5], 40)
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [header, *rows]
    ]
    if not report["checked"]:
        lines.append("")
        lines.append(
            "Targets are imported lazily; run `fabric plugins --check` to import each one and test availability."
        )
    answering = [p for p in report["plugins"] if p["decision_hooks"]]
    if answering:
        lines.append("")
        lines.append("Decision hooks answered (asked tryfirst, plain, trylast; earlier in the load order first):")
        for p in answering:
            lines.append(f"  {p['distribution']}: {', '.join(p['decision_hooks'])}")
    heavy = [p for p in report["plugins"] if p.get("heavy_imports")]
    if heavy:
        lines.append("")
        lines.append("Registration modules that import heavy modules (every Fabric() pays for this; register import strings):")
        for p in heavy:
            lines.append(f"  {p['distribution']} (plugin {p['plugin']!r}): {', '.join(p['heavy_imports'])}")
    if report["conflicts"]:
        lines.append("")
        lines.append("Conflicting registrations (earlier in the load order wins unless a plugin passed override=True):")
        for c in report["conflicts"]:
            lines.append(f"  {c['kind']} {c['name']!r}: using {c['used']}, ignoring {c['ignored']} ({c['reason']})")
    if report["blocked"]:
        lines.append("")
        lines.append("Installed but switched off by FABRIC_DISABLE_PLUGINS: " + ", ".join(report["blocked"]))
    if report["not_loaded"]:
        lines.append("")
        lines.append(
            "Installed but not loaded (FABRIC_DISABLE_PLUGIN_AUTOLOAD is set; list them in FABRIC_PLUGINS): "
            + ", ".join(report["not_loaded"])
        )
    for unknown in report["unknown_names"]:  # Fabric() warns about these; the report must not hide them
        lines.append("")
        lines.append(
            f"{unknown['variable']} names {unknown['name']!r}, but no installed Fabric plugin has that entry-point or"
            " distribution name (the distributions above are what is installed)."
        )
    if report["failures"]:
        lines.append("")
        lines.append(
            "Plugin failures (only the names they did not register are missing; everything else works):"
        )
        for f in report["failures"]:
            version = f" {f['version']}" if f["version"] else ""
            lines.append(f"  {f['distribution']}{version} (plugin {f['plugin']!r}, {f['stage']}): {f['error']}")
    return "\n".join(lines)


def plugins_main(args: argparse.Namespace) -> int:
    from fabric_core.plugins.host import get_registry
    from fabric_core.plugins.registry import FabricPluginWarning

    # Failures and conflicts are part of the report below; don't print them a second time as Python warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FabricPluginWarning)
        registry = get_registry()
        report = collect_plugins(registry, check=args.check, kinds=args.kind or None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    broken = report["failures"] or any(e["status"] == "error" for e in report["entries"])
    if args.check and (broken or any(p.get("heavy_imports") for p in report["plugins"])):
        return 1
    return 0


# ------------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from fabric_core.plugins.kinds import KINDS

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fabric: run PyTorch training scripts on any device, strategy and precision.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s (fabric-core) {_core_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = subparsers.add_parser(
        "plugins",
        help="list installed accelerators, strategies, precisions, launchers and cluster environments",
        description=(
            "List every registered name with its kind, aliases, providing distribution and version. Names are"
            " listed without importing their implementation; --check imports each one and reports whether it is"
            " usable here (for accelerators: whether the hardware is available). Plugins that failed to load"
            " are listed with their error. Exit status with --check: 1 if anything is broken."
        ),
    )
    plugins.add_argument("--check", action="store_true", help="import every target and test availability")
    plugins.add_argument("--json", action="store_true", help="print machine-readable JSON")
    plugins.add_argument("--kind", action="append", choices=KINDS, help="only this kind (repeatable)")
    plugins.set_defaults(handler=plugins_main)

    from fabric_core.cli_chaos import add_chaos_parser
    from fabric_core.cli_consolidate import add_consolidate_parser
    from fabric_core.cli_env import add_env_parser
    from fabric_core.cli_goodput import add_goodput_parser
    from fabric_core.cli_ledger import add_ledger_parser
    from fabric_core.cli_run import add_run_parser

    add_run_parser(subparsers)
    add_consolidate_parser(subparsers)
    add_env_parser(subparsers)
    add_ledger_parser(subparsers)
    add_goodput_parser(subparsers)
    add_chaos_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fabric`` console script and of ``python -m fabric_core``."""
    from fabric_core.plugins.registry import FabricPluginWarning

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # `run` parses its own line: Fabric's options may come after SCRIPT
        from fabric_core.cli_run import main as run

        return run(argv[1:])
    # Building the registry reports broken or conflicting plugins as warnings; they are part of the `fabric plugins`
    # report, so only other commands show them.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FabricPluginWarning)
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        try:
            return int(args.handler(args) or 0)
        finally:
            for w in caught:
                if not (args.command == "plugins" and issubclass(w.category, FabricPluginWarning)):
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


if __name__ == "__main__":
    sys.exit(main())
