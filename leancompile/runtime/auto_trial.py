"""auto at run time: the per-row program tried against native over whole cycles of the loop.

In ``wrap`` a cycle runs from one rollout's first call to the next's (a rollout: calls without grad after an
optimizer step); in ``optimize`` it is one of the trainer's steps, from its start to its end (what the caller runs
between steps is neither program's: a benchmark stepping other trainers in between diluted a 6% gain to 2%). Either
holds all the loop does: the rollout, its rewards, the update, its optimizer steps, the engine's checks, and a
compile that recurs at every step (a module whose state differs at each). Timing single calls beside the program
misses what a step costs around them (caches the program's kept activations push out, gradients accumulated rather
than returned), and did so by 20-40% on the CPU; a cycle is the unit the user's speed is measured in.

The first cycle runs the program and compiles it; then ``PAIRS`` pairs of cycles alternate native and the program,
each pair under the load of its moment, and the median of the pairs' ratios decides: the program stays where it
measured at least ``AUTO_GAIN`` times native's speed, else the loop runs natively from then on. Native cycles cost
nothing against native; the program's cost at most their own loss.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

PAIRS = 3  # alternating native and program cycles compared, after the first (compiling) cycle
# The least gain for which auto keeps the program: below it the kept activations' memory buys too little, and the
# spread of a median over three pairs (2-3% on a loaded machine) could hide a loss.
AUTO_GAIN = 1.02


@dataclass(frozen=True)
class Verdict:
    keeps: bool  # whether the program keeps serving
    gain: float  # median over the pairs of native's cycle seconds over the program's
    native: float  # median seconds of a native cycle
    program: float
    compiled: float  # seconds the first cycle compiled, paid once

    def measured(self) -> str:
        return (f"auto: {PAIRS} pairs of whole loop cycles (rollout to rollout) run alternately natively and with the "
                f"per-row program took {self.native:.3g} s and {self.program:.3g} s a cycle (medians): "
                f"{self.gain:.2f}x" + ("" if self.keeps else f", below {AUTO_GAIN}x"))

    def __str__(self) -> str:
        said = self.measured()
        if not self.keeps:
            return f"{said}: the module runs natively from now on"
        saved = self.native - self.program
        return f"{said}; the first cycle's compile ({self.compiled:.1f} s) is repaid after {self.compiled / saved:.0f} cycles"


class Trial:
    """Which of native and the program runs each cycle, their seconds, and the verdict once ``PAIRS`` pairs ran."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {"native": [], "program": []}
        self.cycles = 0  # begun
        self.mode = "program"  # the current cycle's
        self.began: float | None = None

    @property
    def native(self) -> bool:
        """Whether the current cycle runs natively (the program is neither run nor kept)."""
        return self.mode == "native"

    def end(self, now: float) -> None:
        """The current cycle ends at ``now`` (seconds), where it has not ended yet."""
        if self.began is not None and self.cycles > 1:  # the first cycle compiled: not compared
            self.seconds[self.mode].append(now - self.began)
        self.began = None

    def rollout(self, now: float, compiled: float) -> Verdict | None:
        """A rollout begins at ``now`` (seconds): the cycle before it ends (where :meth:`end` has not ended it), and
        the next one's mode is set. Returns the verdict when this ends the last pair (``compiled``: the program's
        compile seconds so far)."""
        self.end(now)
        self.began, self.cycles = now, self.cycles + 1
        self.mode = "native" if self.cycles % 2 == 0 else "program"
        if len(self.seconds["program"]) < PAIRS:
            return None
        pairs = zip(self.seconds["native"], self.seconds["program"])
        gain = statistics.median(native / program for native, program in pairs)
        return Verdict(gain >= AUTO_GAIN, gain, statistics.median(self.seconds["native"]),
                       statistics.median(self.seconds["program"]), compiled)
