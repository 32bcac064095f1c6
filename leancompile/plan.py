"""Plans: what the optimized trainer does at each denoising step, and why."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepAction:
    step: int
    action: str  # "retain" | "retain@f" | "offload" | "reweight" | "recompute" | "native" | "no-grad"
    reason: str

    @property
    def kind(self) -> str:
        """The action without its fraction: ``"retain@0.40"`` is ``"retain"``."""
        return self.action.split("@")[0]

    @property
    def fraction(self) -> float:
        """The fraction of the activations a partial retention keeps (1 otherwise)."""
        return float(self.action.split("@")[1]) if "@" in self.action else 1.0

    @property
    def keeps(self) -> bool:
        """Whether the rollout keeps this step's call for the update."""
        return self.kind in ("retain", "offload", "reweight")


@dataclass(frozen=True)
class Plan:
    """A schedule for every denoising step of a GRPO step, with the analyses that justify it."""

    schedule: str  # "retain" | "reweight" | "native"
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
        lines += [f"  {a.step:>4}  {a.action:<10} {a.reason}" for a in self.steps]
        return "\n".join(lines)
