"""The benchmark sections: one module each, defining ``SECTION`` (see ``benchmarks/section.py``).

The harness discovers every module here whose name does not start with ``_``; ``_``-modules are helpers shared
by a few sections.
"""
