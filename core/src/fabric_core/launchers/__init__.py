"""Launchers: how the processes of a multi-process run are started."""

from fabric_core.launchers.base import Launcher, ScriptRequest

__all__ = ["Launcher", "ScriptRequest"]
