"""Registers two strategies; the module behind one of them cannot be imported."""

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_strategies(registrar):
    registrar.add("bad_target", "fabric_bad_target.broken:BrokenStrategy", description="its module fails")
    registrar.add("good_target", "fabric_bad_target.good:GoodStrategy", description="works")
