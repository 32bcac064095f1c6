"""Benchmark of ``leancompile.optimize(schedule="retain")`` against the native program.

For each tiny backbone family and each trainer, two trainers are built from one seed: the native program and
the Retain rewrite. Their GRPO steps are timed interleaved, their FLOPs counted, and their weights compared at
the end, so a speedup is only reported for a run that trained the same model. ``python -m benchmarks`` writes
``bench-out/results.json`` and ``bench-out/results.md``.
"""
from .cases import Case, cases
from .measure import measure_case

__all__ = ["Case", "cases", "measure_case"]
