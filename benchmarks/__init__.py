"""Side-by-side benchmarks: fabric-core against plain PyTorch (and lightning-fabric when it is installed).

Run ``python -m benchmarks`` (``make bench``), or ``python -m benchmarks --quick`` for a run under a minute.
Every section measures the variants interleaved (A B A B ..., with the order rotated each repetition) in one
run, so a noisy machine slows all of them alike, and reports medians, min-max and ratios against raw PyTorch.
Results go to ``benchmarks/results/latest.json`` and into the generated part of ``docs/benchmarks.md``.
"""
