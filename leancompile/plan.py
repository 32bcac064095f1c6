"""Plans: what the optimized trainer does at each denoising step, and why. Small frozen values."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Schedule(str, enum.Enum):
    """The program a plan runs."""

    RETAIN = "retain"  # the rollout keeps the trained steps' activations for the update's backward
    REWEIGHT = "reweight"  # the rollout backpropagates provisional gradients; the update combines them
    OFFLOAD = "offload"  # as RETAIN, the activations waiting in host memory
    NATIVE = "native"  # the trainer's own program

    def __str__(self) -> str:
        return self.value


AUTO = "auto"  # the request for the fastest program that fits, native included (the planner's choice)
# What an answer is checked against besides the call's state (``verify``): the digest of the weights' values, sound
# whatever writes them, or their version counters alone, which trusts that nothing writes them through .data
VALUES, VERSIONS = "values", "versions"
VERIFY = (VALUES, VERSIONS)


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
    # Of what the schedule keeps: the activations a partial retention keeps (its activation memory budget); the
    # blocks' parameters whose per-sample gradients a partial Reweight keeps (the last blocks; the first recompute)
    fraction: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "kind", Action(self.kind))
        if not 0 <= self.fraction <= 1 or (self.fraction < 1 and self.kind not in (Action.RETAIN, Action.REWEIGHT)):
            raise ValueError(f"fraction must be in [0, 1], and below 1 only for retain and reweight; got {self.kind} "
                             f"at {self.fraction!r}")

    @property
    def label(self) -> str:
        """``"retain"``, ``"retain@0.40"`` for a partial retention (``"reweight@0.40"``), ``"no-grad"``, ..."""
        return f"{self.kind}@{self.fraction:.2f}" if self.fraction < 1 else str(self.kind)

    @property
    def keeps(self) -> bool:
        return self.kind.keeps


@dataclass(frozen=True)
class Linearity:
    """Whether the update's loss is affine in the advantages at ratio 1 (what Reweight needs)."""

    affine: bool
    reason: str | None  # why not, naming the node and op
    ties: tuple[str, ...]  # max/min nodes proven to tie at ratio == 1
    advantage_free: tuple[str, ...]  # summands of the loss that do not depend on the advantages
    row_mean: bool = True  # the advantages reach the loss through means only (a sum over rows would not be)

    def __str__(self) -> str:
        if not self.affine:
            return f"not affine in the advantages: {self.reason}"
        return (f"affine in the advantages at ratio 1 (ties proven: {', '.join(self.ties) or 'none'}; "
                f"advantage-free terms: {', '.join(self.advantage_free) or 'none'})")


@dataclass(frozen=True)
class Finding:
    """What the validity check found about reusing the rollout's call in the update."""

    kind: str  # "mode" | "rng" | "numerics"
    message: str
    refuses: bool

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class SharedCall:
    """The update's backbone call that recomputes a rollout call, as shared-backbone detection found it."""

    update_call: int
    rollout_call: int
    nodes: int  # aten nodes of the update that are reused
    parameters: int  # parameters the call reads
    segments: int  # segments of its batch (2 under CFG by batch doubling)
    unshared: tuple[tuple[int, str], ...] = ()  # other update calls, and why they are not shared

    def __str__(self) -> str:
        unshared = "".join(f"; update call {i} not shared: {why}" for i, why in self.unshared)
        return (f"update call {self.update_call} recomputes rollout call {self.rollout_call} ({self.nodes} aten "
                f"nodes, {self.parameters} parameters, batch of {self.segments} segment(s)){unshared}")


@dataclass(frozen=True)
class Refusal:
    """A schedule that cannot give native's gradient for this trainer, and why."""

    schedule: Schedule
    reason: str

    def __str__(self) -> str:
        return f"{str(self.schedule).capitalize()} refused: {self.reason}"


@dataclass(frozen=True)
class Plan:
    """A schedule for every denoising step of a GRPO step, with the analyses that justify it, as records;
    :meth:`facts` renders them once, for the text (``str``) and the HTML report."""

    schedule: Schedule
    requested: str  # what the user asked for ("auto", "retain", ...)
    steps: tuple[StepAction, ...]
    choice: str  # why this schedule rather than the others
    shared: SharedCall | None = None  # None: no update call recomputes a rollout call
    findings: tuple[Finding, ...] = ()  # validity findings (numerics, refusals)
    linearity: Linearity | None = None  # None: not analysed
    refusals: tuple[Refusal, ...] = ()  # the schedules that cannot run here
    pruned: tuple[int, ...] = ()  # segments of the shared call's batch that carry no gradient: nothing kept
    reuse: str = "none"  # the rule by which an update call is served from the rollout
    buffers: str = "none"  # how the schedule holds what it keeps until the update, and why
    cost: object = None  # the planner's predictions (a leancompile.cost.CostPlan) when auto chose
    exactness: str = ""  # how close to native's bits the program is, and why

    def facts(self) -> tuple[tuple[str, str], ...]:
        pruned = (f"segment(s) {list(self.pruned)} of the batch carry no gradient (e.g. a detached CFG branch): the "
                  "rollout keeps nothing for them") if self.pruned else "nothing"
        facts = [("schedule", f"{self.schedule} (requested {self.requested})"),
                 ("shared backbone", str(self.shared) if self.shared else "no update call recomputes a rollout call"),
                 ("reuse", self.reuse), ("pruned", pruned),
                 ("linearity", str(self.linearity) if self.linearity else "not analysed"),
                 ("buffers", self.buffers), ("choice", self.choice), ("exactness", self.exactness)]
        facts += [("refusal", str(r)) for r in self.refusals]
        facts += [("finding", str(f)) for f in self.findings]
        return tuple(facts)

    def __str__(self) -> str:
        lines = [f"leancompile plan: schedule={self.schedule} (requested {self.requested})"]
        lines += [f"  {name + ':':<16} {value}" for name, value in self.facts()[1:]]
        if self.cost is not None:
            lines += ["  " + line for line in str(self.cost).splitlines()]
        lines.append(f"  {'step':>4}  {'action':<10} reason")
        lines += [f"  {a.step:>4}  {a.label:<10} {a.reason}" for a in self.steps]
        return "\n".join(lines)
