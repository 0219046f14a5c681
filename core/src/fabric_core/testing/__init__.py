"""Utilities for testing training runs as users run them: :mod:`fabric_core.testing.chaos`, the chaos harness
behind ``fabric chaos`` (faults injected on a seeded schedule, recovery checked). Modules are imported where used."""
