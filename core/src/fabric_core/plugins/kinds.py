"""The kinds of objects a plugin registers by name, declared once.

Each kind is registered through its own hook (:mod:`fabric_core.plugins.hookspecs`); the registry keeps one table
of names per kind, discovery calls the hooks kind by kind in this order, and ``fabric plugins`` lists them. Adding
a kind is this one line, its ``fabric_register_<kinds>`` specification in :mod:`~fabric_core.plugins.hookspecs`,
and its section in ``docs/plugins.md`` (a meta-test checks that the three agree).
"""

from __future__ import annotations

#: kind -> the registration hook that adds names of that kind.
KINDS: dict[str, str] = {
    "accelerator": "fabric_register_accelerators",
    "strategy": "fabric_register_strategies",
    "precision": "fabric_register_precisions",
    "launcher": "fabric_register_launchers",
    "environment": "fabric_register_environments",
    "logger": "fabric_register_loggers",
    "checkpoint_format": "fabric_register_checkpoint_formats",
}
