"""A third-party plugin written against the import paths of fabric-core before the plugin host moved."""
