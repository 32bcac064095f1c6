"""The schedules leancompile runs, one record each: when it applies, what it costs, and what runs it.

``optimize`` reads only this registry: a schedule's ``refusal`` says why it cannot give native's gradient for a
trainer (the analyses' records in hand), its ``estimate`` is the cost planner's prediction of its step
(:mod:`leancompile.cost.planner`), and its ``build`` makes the per-step actions, the graphs to inspect and the
engine that runs it (:mod:`leancompile.runtime`). A refused schedule falls back to its ``fallback``.

A new schedule takes three files: its member of :class:`~leancompile.plan.Schedule`, its runtime (a
:class:`~leancompile.runtime.schedule_runtime.ScheduleRuntime`: its hooks, what a kept call keeps per row and how a
served call's backward turns its cotangent into gradients), and its :class:`ScheduleSpec` in ``SCHEDULES`` below.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import passes
from .cost.planner import (Estimate, Estimator, StepModel, all_steps, estimate_retain, estimate_reweight, format_bytes,
                           reweight_per_block)
from .plan import Action, Linearity, Refusal, Schedule, StepAction
from .runtime.bitwise import BitwiseRetain
from .request import Request
from .runtime.engine import ReuseEngine
from .runtime.policy import StepPolicy
from .runtime.regional import RegionalEngine
from .runtime.retain import Retain
from .runtime.reweight import Reweight
from .runtime.rowwise import RowwiseBackbone
from .runtime.schedule_runtime import ScheduleRuntime


@dataclass(frozen=True)
class Analyses:
    """What the passes found about a trainer's programs: what a schedule's refusal and build read."""

    trainer: object  # the trainer on the weights a rewritten step runs on
    programs: object  # passes.Programs: the traced rollout and update
    shared: object  # passes.SharedBackbone: the update's call that recomputes a rollout call
    linearity: Linearity
    request: Request
    history: passes.PassHistory
    cost: object = None  # the planner's CostPlan, when auto chose

    @property
    def pair(self) -> tuple[int, int]:
        return self.shared.pairs[0]


@dataclass(frozen=True)
class Built:
    """What a schedule's build gives ``optimize``: the plan's per-step actions and details, the graphs to
    inspect, and the engine that runs the step."""

    steps: tuple[StepAction, ...]
    graphs: dict
    engine: ReuseEngine
    exactness: str
    pruned: tuple[int, ...] = ()  # segments of the batch gradient-need pruning keeps nothing for
    buffers: str = "none"  # how the schedule holds what it keeps until the update, and why
    runs: str = ""  # how the runtime runs it, added to the plan's choice


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule."""

    schedule: Schedule
    summary: str  # what it does, in one line
    refusal: Callable[[Analyses], str | None]  # why it cannot give native's gradient here (None: it can)
    estimate: Estimator  # the planner's prediction of its step
    build: Callable[[Analyses, tuple[StepAction, ...]], Built]  # given the planner's actions per trained step
    runtime: Callable[..., ScheduleRuntime]  # what kept calls keep and how served calls' backwards run
    fallback: Schedule = Schedule.NATIVE  # what runs where it is refused


# ----------------------------------------------------------------------------------------------------- Retain

def _retain_refusal(analyses: Analyses) -> str | None:
    return None  # every verified shared call can keep its activations


def _build_retain(a: Analyses, planned: tuple[StepAction, ...], kind: Action = Action.RETAIN) -> Built:
    request, history, programs = a.request, a.history, a.programs
    layout = a.shared.layout
    need = history.analyse("prune_gradient_need", "update", passes.prune_gradient_need, programs.update, a.pair[0],
                           layout.segments, found=lambda n: f"pruned segments {list(n.pruned)}")
    rewritten = history.analyse("rewrite_for_retain", "rollout + update", passes.rewrite_for_retain,
                                programs.rollout, programs.update, a.pair,
                                found=lambda r: f"inserted {', '.join(r.inserted)}; removed {len(r.removed)}")
    graphs = {"rollout": rewritten.rollout, "update": rewritten.update,
              "rollout_traced": programs.rollout, "update_traced": programs.update}
    partial = request.memory_budget is not None and request.memory_budget < 1
    if request.bitwise:  # the eager graph is kept whole or not at all
        planned = tuple(s if s.kind is Action.RECOMPUTE or (s.kind is Action.RETAIN and s.fraction == 1)
                        else StepAction(s.step, Action.RECOMPUTE) for s in planned)
    steps = plan_steps(a.trainer.config, StepAction(0, kind, fraction=request.memory_budget if partial else 1.0),
                       planned)
    if request.bitwise:
        # The eager graph is kept whole: nothing pruned.
        return Built(steps, graphs, _engine(a.trainer, BitwiseRetain(), steps, request, history), EXACTNESS_BITWISE)
    per_block = request.per_block
    if per_block is None:  # under FSDP2 per block, unless auto's plan prices the partition on gathered weights
        per_block = a.trainer.sync.kind == "fsdp" and (a.cost is None or a.cost["auto"].per_block)
    runs = ""
    if per_block:
        runs = PER_BLOCK
        if any(s.fraction < 1 for s in steps if s.keeps):
            runs += ", a step retained at a fraction f running each block's partition at activation budget f"
    kept = Retain(layout.segments, need.pruned)
    return Built(steps, graphs, _engine(a.trainer, kept, steps, request, history, per_block),
                 EXACTNESS[Schedule.RETAIN], pruned=tuple(need.pruned), runs=runs)


# ---------------------------------------------------------------------------------------------------- Offload

def _offload_refusal(a: Analyses) -> str | None:
    if a.request.bitwise:
        return "bitwise=True keeps each call's eager autograd graph, which lives on the device"
    if a.request.memory_budget is not None and a.request.memory_budget < 1:
        return "memory_budget < 1 keeps part of the activations on the device; offload keeps all of them on the host"
    return None


def estimate_offload(m: StepModel) -> Estimate:
    """Retain's saved tensors, copied to host memory after each kept call and back for the update's backward: the
    device holds native's memory, the step pays both copies over the host link."""
    if not m.device.host_link:
        return Estimate(str(Schedule.OFFLOAD), False, 0, (), math.inf, math.inf,
                        note=f"{m.device.name}'s memory is the host's: there is nothing to offload to")
    held = m.retained_step_bytes(m.per_block)
    eligible = m.geometry.eligible
    copies = 2 * held / m.device.host_link
    return m.estimate(str(Schedule.OFFLOAD), m.static if m.per_block else m.gathered,
                      {"activations (one call)": m.transient},
                      m.native.seconds - eligible * (m.saved_seconds - copies) + m.program_seconds(eligible),
                      m.native.flops - eligible * m.saved_flops, all_steps(Action.OFFLOAD, eligible),
                      note=f"every trained step copies {format_bytes(held)} to the host and back")


# --------------------------------------------------------------------------------------------------- Reweight

def _reweight_refusal(a: Analyses) -> str | None:
    """Why Reweight cannot give the native gradient here (None if it can)."""
    linearity = a.linearity
    if a.request.bitwise:
        return "bitwise=True, and its gradient is a combination of provisional gradients"
    if not linearity.affine:
        return f"the loss is not affine in the advantages ({linearity.reason})"
    if not linearity.row_mean:
        return "the loss sums over the micro-batch's rows; Reweight reads a mean"
    if a.shared.numerics_only:
        return "the update's numerics differ from the rollout's (casts or kernels), so ratio != 1"
    return None


def _build_reweight(a: Analyses, planned: tuple[StepAction, ...]) -> Built:
    # Traced on first access: a second trace of the backbone, forward and backward, that only inspection reads.
    graphs = Graphs(rollout=functools.partial(passes.capture_provisional, a.trainer), update=a.programs.update,
                    rollout_traced=a.programs.rollout)
    steps = plan_steps(a.trainer.config, StepAction(0, Action.REWEIGHT), planned)
    kept = Reweight(bool(a.linearity.advantage_free))
    per_block, fsdp = a.request.per_block, a.trainer.sync.kind == "fsdp" and a.trainer.sync.world_size > 1
    if per_block is None:  # under FSDP2 per block where every rank keeps the same steps (see reweight_per_block)
        per_block = a.trainer.sync.kind == "fsdp" and reweight_per_block(a.trainer.config)
    elif per_block and fsdp and not reweight_per_block(a.trainer.config):
        raise ValueError(f"per_block=True with schedule='reweight' under FSDP2 and trained_steps="
                         f"{a.trainer.config.trained_steps!r}: each rank draws its own trained steps, and the loss "
                         "heads that follow each kept rollout step would pass through FSDP2's per-block collectives "
                         "on some ranks only (a deadlock); use trained_steps='first', or per_block=None (Reweight "
                         "on the gathered weights)")
    if not per_block and any(s.fraction < 1 for s in steps if s.keeps):
        raise ValueError("the plan keeps Reweight's per-sample gradients for part of the blocks, which runs per "
                         "block only; use per_block=None or True")
    return Built(steps, graphs, _engine(a.trainer, kept, steps, a.request, a.history, per_block),
                 EXACTNESS[Schedule.REWEIGHT],
                 buffers=("one provisional gradient per kept row and trained step (per basis cotangent: the policy "
                          "term, and the advantage-free terms where the loss has them), each used by at most one "
                          "call with grad" + (" (per block: of each block's weights as FSDP2 gathers them, "
                                              "unreduced)" if per_block else "")),
                 runs=(PER_BLOCK + (", the per-sample gradients of the last blocks only (reweight@f), the first "
                                    "recomputing in the update" if any(s.fraction < 1 for s in steps) else ""))
                 if per_block else "")


SCHEDULES: dict[Schedule, ScheduleSpec] = {spec.schedule: spec for spec in (
    ScheduleSpec(Schedule.RETAIN, "keep the rollout's activations for the update's backward",
                 _retain_refusal, estimate_retain, _build_retain, Retain),
    ScheduleSpec(Schedule.REWEIGHT, "backpropagate during the rollout at provisional advantages and correct once "
                 "the advantages are known", _reweight_refusal, estimate_reweight, _build_reweight, Reweight,
                 fallback=Schedule.RETAIN),
    ScheduleSpec(Schedule.OFFLOAD, "keep the rollout's activations in host memory for the update's backward",
                 _offload_refusal, estimate_offload, functools.partial(_build_retain, kind=Action.OFFLOAD), Retain,
                 fallback=Schedule.RETAIN),
)}


def estimators() -> dict[Schedule, Callable[[StepModel], Estimate]]:
    """Every schedule's cost estimate, for the planner."""
    return {name: spec.estimate for name, spec in SCHEDULES.items()}


def refusals(analyses: Analyses) -> tuple[Refusal, ...]:
    """The schedules that cannot run for ``analyses``, and why."""
    found = (Refusal(name, spec.refusal(analyses)) for name, spec in SCHEDULES.items())
    return tuple(r for r in found if r.reason is not None)


# ----------------------------------------------------------------------------------------- what builds share

PER_BLOCK = "run per transformer block (runtime.regional)"

EXACTNESS = {
    Schedule.NATIVE: "native: the trainer's own program",
    Schedule.RETAIN: ("exact in real arithmetic, float64 within rounding: the rollout's kept calls return native's "
                      "bits, but the per-row backward rounds differently from native's, so a float32 or bf16 run "
                      "drifts from native's after its first optimizer step (bitwise=True keeps its bits)"),
    Schedule.REWEIGHT: ("exact in real arithmetic, float64 within rounding: the gradient is a combination of "
                        "provisional gradients, rounded differently from native's backward"),
}
EXACTNESS_BITWISE = ("bitwise native (bitwise=True): both phases run the module's own eager kernels, and a call is "
                     "served only where its batch is a kept call's, so rollouts, gradients and weights are native's "
                     "to the bit in any precision")


class Graphs(dict):
    """The optimized trainer's graphs by name. An entry may be a function that traces it, called on first read."""

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if not isinstance(value, torch.fx.GraphModule):
            value = value()
            super().__setitem__(name, value)
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default

    def items(self):
        return [(name, self[name]) for name in self]

    def values(self):
        return [self[name] for name in self]


def _engine(trainer, schedule_runtime: ScheduleRuntime, steps, request: Request, history: passes.PassHistory,
            per_block: bool = False):
    """The engine for ``trainer``'s backbone: one per-row backbone per activation budget the plan uses, or with
    ``per_block`` one engine per transformer block (FSDP2's own gathers kept, see runtime.regional), each with one
    per-row block per budget."""
    # activation budgets (a partial Reweight's fraction is of the blocks it keeps, each whole)
    fractions = {s.fraction for s in steps if s.keeps and s.kind is not Action.REWEIGHT} | {1.0}
    if per_block:
        backbone = trainer.backbone
        if trainer.sync.kind == "fsdp":
            # Back to the shards first: the engines read each block's parameters now, and must see the shards the
            # optimizer updates (their versions), not the gathered copies the analyses ran on (``trainer`` may be
            # the view on those: the sharded backbone is the sync's).
            trainer.sync.run_per_block()
            backbone = trainer.sync.root
        blocks = [block for _, stack in backbone.block_stacks() for block in stack]
        return RegionalEngine(backbone, blocks, schedule_runtime.for_block, request.tune_matmuls, history,
                              shared=backbone.spec.block_shared, fractions=tuple(fractions), policy=StepPolicy(),
                              verify=request.verify)
    # The whole call runs on the weights the step runs on: the trainer's, or under FSDP2 its gathered copy (the
    # analyses ran on fake ones).
    with trainer.sync.whole_weights(trainer) as (backbone, _):
        pass
    rowwise = {f: RowwiseBackbone(backbone, f, tune_matmuls=request.tune_matmuls, history=history)
               for f in sorted(fractions)}
    return ReuseEngine(backbone, schedule_runtime, rowwise, StepPolicy(), sync=trainer.sync, verify=request.verify)


_HOW = {Action.RETAIN: "the rollout keeps its activations for the update's calls",
        Action.REWEIGHT: "the rollout backpropagates it at provisional advantages; the update's calls add the "
                         "combination their cotangents call for",
        Action.OFFLOAD: "the rollout keeps its activations in host memory for the update's calls",
        Action.RECOMPUTE: "retaining it does not fit the memory budget: the update recomputes it"}
_PARTIAL = {Action.RETAIN: "the rollout keeps a fraction {:.2f} of its activations, the backward recomputes the rest",
            Action.REWEIGHT: ("the rollout backpropagates the last blocks, {:.0%} of the blocks' parameters, at "
                              "provisional advantages; the update recomputes the first blocks and adds the "
                              "combination its cotangents call for of the others")}
_TRAINED = {"first": "trained by every sample", "random": "trained by the samples that draw it",
            "window": "trained when inside the SDE window"}


def plan_steps(config, default: StepAction, planned: tuple[StepAction, ...] = ()) -> tuple[StepAction, ...]:
    """Per denoising step; ``planned`` is the planner's action per trained step, by position, ``default`` the
    action of the others."""
    steps, position = [], 0
    for i in range(config.num_steps):
        if config.trained_steps == "first" and i >= config.num_trained_steps:
            steps.append(StepAction(i, Action.NO_GRAD, "never trained: the rollout runs it without grad"))
            continue
        this = planned[position] if position < len(planned) else default
        position += 1
        reason = _PARTIAL[this.kind].format(this.fraction) if this.fraction < 1 else _HOW[this.kind]
        if this.kind is not Action.RECOMPUTE:
            reason += ", served to each call verified to recompute it"
        steps.append(StepAction(i, this.kind, f"{_TRAINED[config.trained_steps]}: {reason}", this.fraction))
    return tuple(steps)
