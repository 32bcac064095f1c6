"""What the per-row program costs beyond its operators' arithmetic, measured on a device: the value the planner
prices it with (the measurement is :mod:`leancompile.runtime.calibration`'s).

Retain and Reweight run the backbone as a traced aten graph (:mod:`leancompile.runtime.rowwise`), whose every
node pays a fixed host cost, as every eager operator does, but not the same one: at small sizes that fixed cost is
most of a call, and a roofline with one launch cost for every operator does not see the difference. The calibration
times one small model of a shipped family (a real block's mix of operators) eagerly and as its per-row program,
each divided by the operators the profile counts (:mod:`leancompile.cost.profile`), the reuse engine's own cost per
call (verifying it, keeping and gathering rows), and compiling the program.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overheads:
    """Seconds per operator (as the profile counts them: views free) of one call of the calibration's model."""

    device: str
    eager_forward: float  # native's forward without grad (the rollout's call), per forward operator
    eager_update: float  # native's forward with grad and its backward (the update's call), per operator of both
    program_forward: float  # the per-row program's forward (a kept call), per forward operator
    program_backward: float  # its backward (a served call: no forward), per operator of the forward and backward
    call: float  # what the reuse engine adds per kept or served call (its checks, keeping, gathering), seconds
    compile: float  # compiling the per-row program (partition, traces, passes), per operator of both
    operators: tuple[int, int]  # the calibration model's forward and backward operators

    def __post_init__(self):
        for name in ("eager_forward", "eager_update", "program_forward", "program_backward", "call", "compile"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be seconds >= 0; got {value!r}")

    def compile_seconds(self, operators: int) -> float:
        """Compiling the per-row program of a call of ``operators`` forward and backward operators."""
        return self.compile * operators

    def __str__(self) -> str:
        us = lambda seconds: f"{seconds * 1e6:.3g}"  # noqa: E731
        return (f"measured on {self.device}, in µs per operator: eager {us(self.eager_forward)} (forward without "
                f"grad), {us(self.eager_update)} (forward and backward); the per-row program "
                f"{us(self.program_forward)} (forward), {us(self.program_backward)} (a served call's backward), and "
                f"{self.call * 1e3:.3g} ms per call of the engine's checks; compiling it {self.compile * 1e3:.3g} ms "
                "per operator")
