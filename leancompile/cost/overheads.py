"""What the per-row program costs beyond its operators' arithmetic, measured on a device: the value the planner
prices it with (the measurement is :mod:`leancompile.runtime.calibration`'s).

Retain and Reweight run the backbone as a traced aten graph (:mod:`leancompile.runtime.rowwise`), whose every
node pays a fixed host cost, as every eager operator does, but not the same one: at small sizes that fixed cost is
most of a call, and the roofline, which prices every operator alike, does not see the difference. The calibration
times one small model of a shipped family (a real block's mix of operators) eagerly and as its per-row program,
each divided by the operators the profile counts (:mod:`leancompile.cost.workload`), and times compiling the
program.
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
    compile: float  # compiling the per-row program (partition, traces, passes), per operator of both
    operators: tuple[int, int]  # the calibration model's forward and backward operators

    def __post_init__(self):
        for name in ("eager_forward", "eager_update", "program_forward", "program_backward", "compile"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be seconds >= 0; got {value!r}")
        if self.eager_forward == 0 or self.eager_update == 0:
            raise ValueError("eager_forward and eager_update must be > 0: the program's costs are priced relative "
                             f"to them; got {self.eager_forward!r} and {self.eager_update!r}")

    @property
    def forward_ratio(self) -> float:
        """The per-row program's forward against eager's without grad, per operator. The calibration's absolute
        per-operator seconds depend on how much Python its model's modules wrap around each operator; their ratio
        is what carries over to another model."""
        return self.program_forward / self.eager_forward

    @property
    def backward_ratio(self) -> float:
        """The per-row program's backward of a served call against eager's forward and backward, per operator."""
        return self.program_backward / self.eager_update

    def compile_seconds(self, operators: int) -> float:
        """Compiling the per-row program of a call of ``operators`` forward and backward operators."""
        return self.compile * operators

    def __str__(self) -> str:
        return (f"measured on {self.device}: per operator, the per-row program's forward costs "
                f"{self.forward_ratio:.2f}x eager's without grad, its backward {self.backward_ratio:.2f}x eager's "
                f"forward and backward with grad; compiling it {self.compile * 1e3:.3g} ms per operator")
