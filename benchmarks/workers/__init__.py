"""Scripts the sections start as separate (often multi-process) jobs; each prints one result line (``_common.emit``)."""
