"""Claims the strategy names 'twin' (first registration wins) and 'replaced' (b overrides)."""

from fabric_core.plugins import hookimpl


@hookimpl
def fabric_register_strategies(registrar):
    registrar.add("twin", "fabric_conflict_a.strategy:StrategyA")
    registrar.add("replaced", "fabric_conflict_a.strategy:StrategyA", override=False)
