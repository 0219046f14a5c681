"""A registration module that cannot be imported: its plugin must be reported, not crash the others."""

import fabric_missing_dependency_for_tests  # noqa: F401  (deliberately not installed)
