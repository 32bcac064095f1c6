"""Benchmark of ``leancompile.optimize`` (Retain, Reweight and auto) against the native program.

For each tiny backbone family, schedule of the originals and tuning, trainers are built from one seed: the native
program and each optimized one. Their GRPO steps are timed interleaved, their FLOPs counted, and their weights
compared at the end, so a speedup is only reported for a run that trained the same model; the planner's
prediction sits next to each measurement. ``python -m benchmarks`` writes ``bench-out/results.json``,
``results.md`` and ``results.png``.
"""
from .cases import Case, cases
from .measure import measure_case

__all__ = ["Case", "cases", "measure_case"]
