"""The ``fabric`` command line: ``fabric plugins``, ``fabric run``, ``fabric consolidate``.

Built on argparse so the core needs no CLI dependency. Importing this module is cheap (no torch): ``fabric
--help`` must answer instantly, and ``fabric plugins`` lists every registered name *without* importing the
modules behind them; ``fabric plugins --check`` imports each one and reports whether it can be used here.

``run`` and ``consolidate`` live in :mod:`fabric_core.cli_run`, which provides
``add_run_parser(subparsers)`` (adds its sub-parsers, ``dest="command"``) and ``run_main(args) -> int``.
It is imported only to build the parser, so a missing module leaves ``fabric plugins`` working.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_core.registry import Entry, Registry

PROG = "fabric"
NOT_CHECKED = "not checked"


def _core_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fabric-core")
    except PackageNotFoundError:  # running from a source tree that is not installed
        from fabric_core import __version__

        return __version__


# ------------------------------------------------------------------------------------------------- fabric plugins


def _entry_status(entry: Entry) -> tuple[str, str | None]:
    """Import ``entry``'s target (and, for an accelerator, ask ``is_available()``): (status, error)."""
    try:
        cls = entry.load()
    except Exception as err:
        cause = err.__cause__ or err
        return "error", f"{type(cause).__name__}: {cause}"
    if entry.kind == "accelerator":
        try:
            return ("available" if cls.is_available() else "unavailable"), None
        except Exception as err:
            return "error", f"is_available() raised {type(err).__name__}: {err}"
    return "available", None


def collect_plugins(
    registry: Registry, check: bool = False, kinds: Sequence[str] | None = None
) -> dict[str, Any]:
    """Everything ``fabric plugins`` shows, as plain data (what ``--json`` prints)."""
    from fabric_core.registry import KINDS

    core_version = _core_version()

    def version_of(entry: Entry) -> str | None:
        return entry.version or (core_version if entry.distribution == "fabric-core" else None)

    entries = []
    for kind in kinds or KINDS:
        for entry in registry.entries(kind):
            status, error = _entry_status(entry) if check else (NOT_CHECKED, None)
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
                    "error": error,
                }
            )
    conflicts = []
    for loser in registry.shadowed:
        if kinds and loser.kind not in kinds:
            continue
        kept = registry._lookup_entry(loser.kind, loser.name)
        conflicts.append(
            {
                "kind": loser.kind,
                "name": loser.name,
                "ignored": loser.distribution,
                "used": kept.distribution if kept is not None else None,
            }
        )
    failures = [
        {
            "plugin": failure.plugin,
            "distribution": failure.distribution,
            "version": failure.version,
            "error": f"{type(failure.error).__name__}: {failure.error}",
        }
        for failure in registry.failures
    ]
    return {
        "fabric_core_version": core_version,
        "checked": check,
        "entries": entries,
        "failures": failures,
        "conflicts": conflicts,
        "not_loaded": sorted(set(registry.skipped)),
    }


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
            e["status"] if e["error"] is None else f"error: {e['error']}",
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
    if report["conflicts"]:
        lines.append("")
        lines.append(
            "Conflicting registrations (the first registration wins unless a plugin passed override=True):"
        )
        for c in report["conflicts"]:
            lines.append(f"  {c['kind']} {c['name']!r}: using {c['used']}, ignoring {c['ignored']}")
    if report["not_loaded"]:
        lines.append("")
        lines.append(
            "Installed but not loaded (FABRIC_DISABLE_PLUGIN_AUTOLOAD is set; list them in FABRIC_PLUGINS): "
            + ", ".join(report["not_loaded"])
        )
    if report["failures"]:
        lines.append("")
        lines.append(
            "Plugin failures (only the names they did not register are missing; everything else works):"
        )
        for f in report["failures"]:
            version = f" {f['version']}" if f["version"] else ""
            lines.append(f"  {f['distribution']}{version} (plugin {f['plugin']!r}): {f['error']}")
    return "\n".join(lines)


def plugins_main(args: argparse.Namespace) -> int:
    from fabric_core.registry import FabricPluginWarning, get_registry

    # Failures and conflicts are part of the report below; don't print them a second time as Python warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FabricPluginWarning)
        registry = get_registry()
        report = collect_plugins(registry, check=args.check, kinds=args.kind or None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    if args.check and (report["failures"] or any(e["status"] == "error" for e in report["entries"])):
        return 1
    return 0


# ------------------------------------------------------------------------------------------------- parser


def _load_cli_run() -> Any | None:
    """The ``run``/``consolidate`` implementation, or ``None`` when this installation does not have it."""
    try:
        return importlib.import_module("fabric_core.cli_run")
    except ImportError as err:
        if err.name == "fabric_core.cli_run":
            return None
        raise  # the module exists but one of its own imports is broken: show that, don't hide the command


def _missing_command(args: argparse.Namespace) -> int:
    print(
        f"error: `fabric {args.command}` is not available in this installation of fabric-core.",
        file=sys.stderr,
    )
    return 1


def build_parser() -> argparse.ArgumentParser:
    from fabric_core.registry import KINDS

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

    cli_run = _load_cli_run()
    if cli_run is not None:
        cli_run.add_run_parser(subparsers)
    if "consolidate" not in subparsers.choices:  # format-agnostic: reads through the checkpoint-loader hook
        from fabric_core.cli_consolidate import add_consolidate_parser

        add_consolidate_parser(subparsers)
    for name in ("run", "consolidate"):
        if name not in subparsers.choices:  # keep the documented commands visible, with a clear error
            placeholder = subparsers.add_parser(
                name, help="(not available in this installation)", add_help=False
            )
            placeholder.add_argument("rest", nargs=argparse.REMAINDER)
            placeholder.set_defaults(handler=_missing_command)
    parser.set_defaults(_cli_run=cli_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fabric`` console script and of ``python -m fabric_core``."""
    from fabric_core.registry import FabricPluginWarning

    # Building the parser may build the registry (``run`` lists installed names as choices). Its warnings about
    # broken or conflicting plugins are part of the ``fabric plugins`` report; for other commands show them.
    with warnings.catch_warnings(record=True) as caught:
        parser = build_parser()
        args = parser.parse_args(argv)
    for w in caught:
        if not (args.command == "plugins" and issubclass(w.category, FabricPluginWarning)):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if args.command is None:
        parser.print_help()
        return 2
    handler = getattr(args, "handler", None)
    if handler is not None:
        return int(handler(args) or 0)
    return int(args._cli_run.run_main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
