"""Plans: what the optimized trainer does at each denoising step, and why. Small frozen values."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Schedule(str, enum.Enum):
    """The program a plan runs."""

    RETAIN = "retain"  # the rollout keeps the trained steps' activations for the update's backward
    REWEIGHT = "reweight"  # the rollout backpropagates provisional gradients; the update combines them
    NATIVE = "native"  # the trainer's own program

    def __str__(self) -> str:
        return self.value


class Action(str, enum.Enum):
    """What the optimized trainer does with one denoising step's backbone calls."""

    RETAIN = "retain"  # the rollout keeps their activations (a fraction of them: partial retention)
    OFFLOAD = "offload"  # the rollout keeps their activations in host memory
    REWEIGHT = "reweight"  # the rollout turns them into provisional per-row gradients
    RECOMPUTE = "recompute"  # keeping them does not fit: the update runs its forward again
    NATIVE = "native"  # the untransformed program
    NO_GRAD = "no-grad"  # never trained: the rollout runs them without grad

    def __str__(self) -> str:
        return self.value

    @property
    def keeps(self) -> bool:
        """Whether the rollout keeps the step's calls for the update."""
        return self in (Action.RETAIN, Action.OFFLOAD, Action.REWEIGHT)


@dataclass(frozen=True)
class StepAction:
    """One step's action: a denoising step's in a plan, a trained step's (by position) in the cost planner's."""

    step: int
    kind: Action
    reason: str = ""
    fraction: float = 1.0  # of the activations a partial retention keeps

    def __post_init__(self):
        object.__setattr__(self, "kind", Action(self.kind))
        if not 0 <= self.fraction <= 1 or (self.fraction < 1 and self.kind is not Action.RETAIN):
            raise ValueError(f"fraction must be in [0, 1], and below 1 only for retain; got {self.kind} "
                             f"at {self.fraction!r}")

    @property
    def label(self) -> str:
        """``"retain"``, ``"retain@0.40"`` for a partial retention, ``"no-grad"``, ..."""
        return f"{self.kind}@{self.fraction:.2f}" if self.fraction < 1 else str(self.kind)

    @property
    def keeps(self) -> bool:
        return self.kind.keeps


@dataclass(frozen=True)
class Plan:
    """A schedule for every denoising step of a GRPO step, with the analyses that justify it."""

    schedule: Schedule
    requested: str  # what the user asked for ("auto", "retain", ...)
    steps: tuple[StepAction, ...]
    reuse: str  # the rule by which an update call is served from the rollout
    shared: str  # what the shared-backbone detection found
    pruned: str  # what gradient-need pruning removed from retention
    findings: tuple[str, ...] = ()  # validity findings (numerics, refusals)
    linearity: str = "not analysed"  # whether the loss is affine in the advantages (what Reweight needs)
    buffers: str = "none"  # how Reweight holds its provisional gradients, and why
    choice: str = ""  # why this schedule rather than the others
    cost: object = None  # the planner's predictions (a leancompile.cost.CostPlan) when auto chose
    exactness: str = ""  # how close to native's bits the program is, and why

    def __str__(self) -> str:
        lines = [f"leancompile plan: schedule={self.schedule} (requested {self.requested})",
                 f"  shared backbone: {self.shared}",
                 f"  reuse:           {self.reuse}",
                 f"  pruned:          {self.pruned}",
                 f"  linearity:       {self.linearity}",
                 f"  buffers:         {self.buffers}",
                 f"  choice:          {self.choice}",
                 f"  exactness:       {self.exactness}"]
        lines += [f"  finding:         {f}" for f in self.findings]
        if self.cost is not None:
            lines += ["  " + line for line in str(self.cost).splitlines()]
        lines.append(f"  {'step':>4}  {'action':<10} reason")
        lines += [f"  {a.step:>4}  {a.label:<10} {a.reason}" for a in self.steps]
        return "\n".join(lines)
