"""auto at run time: the per-row program's measured time against native's for the same calls, and the verdict.

The planner predicts; where its prediction is wrong (sizes at which fixed costs it models only roughly decide), the
runtime measures. The program's time comes from the engine's records (an engine built with ``timed=True`` times
each kept call's forward and each served call's backward); native's is measured once, on a call's own arguments,
outside the loop's state (its gradients are returned, not accumulated). Where the program is measured slower than
native, the caller runs natively from then on and says why: auto keeps only a program that measures no slower, so
that what the measurement misses (its noise under load, costs outside the timed calls) stays within its floor.
"""
from __future__ import annotations

import statistics
import time

import torch

from .calls import output_layout

# auto's floor: a loop under auto runs at least this fraction of native's speed (0: auto never falls back)
AUTO_FLOOR = 0.97


def slower(program: float, native: float) -> bool:
    """Whether ``program`` seconds are measured above ``native``'s: auto then runs natively (never where
    ``AUTO_FLOOR`` is 0)."""
    return AUTO_FLOOR > 0 and program > native


def program_seconds_per_row(records, action: str) -> float:
    """The program's median seconds per row over its calls recorded as ``action`` ("kept": a forward and its keep;
    "served": a backward); compile time is not in a record's (0: none timed)."""
    timed = [r.seconds / r.rows for r in records if r.action == action and r.seconds > 0 and r.rows]
    return statistics.median(timed) if timed else 0.0


def forward_seconds(module: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """Native's forward without grad on this call (the rollout's), to the device's end."""
    start = now()
    with torch.no_grad():
        torch.nn.Module.__call__(module, *args, **kwargs)
    return now() - start


def update_seconds(module: torch.nn.Module, trainable: list, args: tuple, kwargs: dict) -> float:
    """Native's forward with grad and its backward on this call (the update's), the gradients returned, not
    accumulated (nothing of the loop's state changes)."""
    start = now()
    with torch.enable_grad():
        output, _, refusal = output_layout(torch.nn.Module.__call__(module, *args, **kwargs))
        if refusal is None and output.requires_grad:
            torch.autograd.grad(output, [p for p in trainable if p.requires_grad], torch.ones_like(output),
                                allow_unused=True)
    return now() - start


def now() -> float:
    """Seconds, once the device has finished what was queued."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class Watch:
    """auto's check of a trainer's first step that serves calls: the program's time for the step's kept and served
    calls (the engine's records and checks) against native's for the same calls, native measured per row on the
    first kept call's arguments (a forward without grad) and on the first served call's (a forward with grad and
    its backward)."""

    def __init__(self, trainable: list):
        self.trainable = trainable
        self.native_forward: float | None = None  # seconds per row
        self.native_update: float | None = None
        self.verdict: str | None = None  # why auto runs natively now (None: it keeps running the program)
        self.weighed = False

    def call(self, engine, module: torch.nn.Module, args: tuple, kwargs: dict):
        """``engine``'s answer to a call of ``module``; native measured on the first kept and served calls."""
        seen = len(engine.log.records)
        output = engine(*args, **kwargs)
        made = {r.action: r.rows for r in engine.log.records[seen:]}
        if self.native_forward is None and "kept" in made:  # the faster of two: the first may warm caches
            self.native_forward = min(forward_seconds(module, args, kwargs) for _ in range(2)) / made["kept"]
        if self.native_update is None and "served" in made:
            self.native_update = min(update_seconds(module, self.trainable, args, kwargs)
                                     for _ in range(2)) / made["served"]
        return output

    def weigh(self, records, check_seconds: float) -> str | None:
        """Once, after the first step that served calls with native measured: the verdict (None: the program is
        not measured slower than native)."""
        kept = sum(r.rows for r in records if r.action == "kept")
        served = sum(r.rows for r in records if r.action == "served")
        if self.weighed or not served or self.native_forward is None or self.native_update is None:
            return None
        self.weighed = True
        program = (kept * program_seconds_per_row(records, "kept") + served * program_seconds_per_row(records, "served")
                   + check_seconds)
        native = kept * self.native_forward + served * self.native_update
        if slower(program, native):
            self.verdict = (f"auto: the per-row program took {program * 1e3:.3g} ms for this step's {kept} kept and "
                            f"{served} served rows (their forwards, backwards and the engine's checks), native "
                            f"{native * 1e3:.3g} ms for the same rows (forwards without grad; forwards and backwards "
                            f"with grad): {native / program:.2f}x, slower than native, so the trainer runs natively "
                            "from the next step on")
        return self.verdict
