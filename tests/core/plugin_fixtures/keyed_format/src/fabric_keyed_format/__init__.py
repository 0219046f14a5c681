"""A checkpoint format registered by a plugin that provides no strategy: one file per top-level key."""
