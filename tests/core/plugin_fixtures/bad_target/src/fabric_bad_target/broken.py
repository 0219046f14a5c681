import fabric_missing_backend_for_tests  # noqa: F401  (deliberately not installed)
