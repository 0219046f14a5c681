"""A checkpoint format of a third party: one numpy ``.npz`` file, written from docs/plugins.md alone."""
