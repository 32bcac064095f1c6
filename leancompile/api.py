"""``leancompile.optimize(trainer)``: run the passes, choose a schedule, return the rewritten trainer."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from . import passes
from .optimized import optimized_class
from .plan import Action, Plan, Schedule, StepAction
from .protocol import check_protocol
from .runtime.bitwise import BitwiseRetain
from .runtime.engine import ReuseEngine
from .runtime.regional import RegionalEngine
from .runtime.retain import Retain
from .runtime.reweight import Reweight
from .runtime.rowwise import RowwiseBackbone
from .cost import planner as cost_planner
from .cost.devices import get_device, live_device
from .cost.scenario import reweight_buffers, trainer_scenario

SCHEDULES = ("auto", "retain", "reweight", "native")


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


REUSE_RULE = ("per backbone call, verified when it happens: every row's inputs bitwise equal to a kept row's, the "
              "same weights (version counters; a fingerprint once per update phase), training flags, adapters and "
              "autocast; anything else recomputes natively (stats: recompute_reasons)")


EXACTNESS = {
    "native": "native: the trainer's own program",
    "bitwise": ("bitwise native (bitwise=True): both phases run the module's own eager kernels, and a call is "
                "served only where its batch is a kept call's, so rollouts, gradients and weights are native's to the "
                "bit in any precision"),
    "retain": ("exact in real arithmetic, float64 within rounding: the per-row program rounds differently from "
               "native's eager kernels, so a float32 or bf16 run drifts from native's (bitwise=True keeps its bits)"),
    "reweight": ("exact in real arithmetic, float64 within rounding: the gradient is a combination of provisional "
                 "gradients, rounded differently from native's backward"),
}


def _native_plan(config, requested: str, shared: str, reason: str, findings=()) -> Plan:
    steps = tuple(StepAction(i, Action.NATIVE, reason) for i in range(config.num_steps))
    return Plan(Schedule.NATIVE, requested, steps, "none", shared, "nothing", tuple(findings), choice=reason,
                exactness=EXACTNESS["native"])


def _engine(trainer, schedule, plan_steps, tune_matmuls: bool, history: passes.PassHistory,
            per_block: bool = False):
    """The engine for ``trainer``'s backbone: one per-row backbone per activation budget the plan uses, or with
    ``per_block`` (Retain) one engine per transformer block (FSDP2's own gathers kept, see runtime.regional)."""
    if per_block and type(schedule) is Retain:
        backbone = trainer.backbone
        if trainer.sync.kind == "fsdp":
            trainer.sync.per_block = True
            # Back to the shards first: the engines read each block's parameters now, and must see the shards the
            # optimizer updates (their versions), not the gathered copies the analyses ran on (``trainer`` may be
            # the view on those: the sharded backbone is the sync's).
            trainer.sync.release()
            backbone = trainer.sync.root
        blocks = [block for _, stack in backbone.block_stacks() for block in stack]
        return RegionalEngine(backbone, blocks, lambda: Retain(schedule.segments, schedule.pruned),
                              tune_matmuls, history, shared=backbone.spec.block_shared)
    fractions = {a.fraction for a in plan_steps if a.keeps} | {1.0}
    rowwise = {f: RowwiseBackbone(trainer.backbone, f, tune_matmuls=tune_matmuls, history=history)
               for f in sorted(fractions)}
    return ReuseEngine(trainer.backbone, schedule, rowwise, sync=trainer.sync)


def optimize(trainer, schedule: str = "auto", memory_budget: float | None = None, strict: bool = False,
             memory_limit: int | None = None, samples_per_step: int | None = None, device=None,
             tune_matmuls: bool = True, bitwise: bool = False, per_block: bool | None = None):
    """Return a trainer that runs the same GRPO step as ``trainer`` with the redundant backbone forward removed.

    Args:
        trainer: an object satisfying the trainer protocol (:mod:`leancompile.protocol`), e.g. a native
            ``FlowGRPOTrainer`` or ``DanceGRPOTrainer``. The result shares its weights, optimizer and generators.
        schedule: ``"auto"`` (the fastest valid schedule), ``"retain"`` (keep the rollout's activations for the
            update's backward), ``"reweight"`` (backpropagate during the rollout with a provisional advantage and
            correct once the advantages are known), or ``"native"`` (the untransformed program). Where the
            requested schedule is not valid the plan falls back (Reweight to Retain, Retain to native) and says why.
        memory_budget: the fraction [0, 1] of the backbone's saved activations a Retain partition may keep; below
            1 the min-cut partitioner recomputes the rest in the backward.
        strict: refuse reuse when the rollout's numerics differ from the update's (precision or casts).
        memory_limit: bytes the auto planner may use on the device (default: its free memory less 10%).
        samples_per_step: samples per GRPO step the auto planner plans for (default: one optimizer step's worth,
            ``train_batch_size * gradient_accumulation_steps``).
        device: a :class:`leancompile.cost.Device` or registered name to plan for (default: the live device).
        tune_matmuls: time each matrix product of the compiled backbone both ways on the device when it compiles
            and run the faster (:mod:`leancompile.passes.matmul_order`); False runs them as traced, so that the
            graphs and their rounding do not depend on timings.
        bitwise: keep native's bits in every precision: Retain keeps the eager autograd graph of each kept rollout
            call and serves an update call only when it holds exactly that call's rows in their order (rollout batch
            equal to the update's micro-batch); other calls recompute natively, Reweight and partial retention are
            refused. Without it Retain is exact in real arithmetic (float64 within 1e-10) but rounds differently.
        per_block: run Retain per transformer block (:mod:`leancompile.runtime.regional`: the module around the
            blocks runs natively, each block's calls are served inside a verified backbone call), which keeps
            FSDP2's per-block gathers and reduce-scatters; a step the plan retains at a fraction f keeps that
            fraction of the blocks. ``None``: per block under FSDP2 (``parallel="fsdp"``) unless auto's plan
            prices the whole call on the gathered weights, the whole call otherwise. Reweight, ``memory_budget``
            and bitwise Retain run the whole call.

    Returns:
        The optimized trainer, with ``.plan``, ``.graphs``, ``.pass_history`` (every pass run, at compile time
        and when the per-row program compiles at the first step) and ``.explain()``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if memory_budget is not None and not 0 <= memory_budget <= 1:
        raise ValueError(f"memory_budget must be a fraction in [0, 1] of the saved activations; got {memory_budget!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False; got {strict!r}")
    if not isinstance(bitwise, bool):
        raise ValueError(f"bitwise must be True or False; got {bitwise!r}")
    if bitwise and memory_budget is not None and memory_budget < 1:
        raise ValueError(f"memory_budget={memory_budget!r} with bitwise=True: partial retention recomputes part of the "
                         "forward in the per-row program, which is not bitwise; drop one of them")
    if per_block is not None and not isinstance(per_block, bool):
        raise ValueError(f"per_block must be True, False or None; got {per_block!r}")
    if per_block and (bitwise or schedule == "reweight" or (memory_budget is not None and memory_budget < 1)):
        raise ValueError("per_block=True runs Retain of whole activations; it cannot serve bitwise=True, "
                         "schedule='reweight' or memory_budget < 1: drop per_block or those")
    if not isinstance(tune_matmuls, bool):
        raise ValueError(f"tune_matmuls must be True or False; got {tune_matmuls!r}")
    if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
        raise ValueError(f"memory_limit must be a positive number of bytes; got {memory_limit!r}")
    if samples_per_step is not None and (not isinstance(samples_per_step, int) or samples_per_step < 2):
        raise ValueError(f"samples_per_step must be an integer >= 2; got {samples_per_step!r}")
    options = _Options(memory_limit, samples_per_step, device, per_block)
    check_protocol(trainer)
    history = passes.PassHistory()
    # Analysed and compiled on the weights a rewritten step runs on (FSDP2: gathered whole, see trainers.parallel).
    with trainer.sync.whole_weights(trainer) as (backbone, trainable):
        subject = trainer if backbone is trainer.backbone else _on_weights(trainer, backbone, trainable)
        programs = history.analyse("capture", "trainer", passes.capture, subject,
                                   found=lambda p: f"rollout {len(p.rollout.graph.nodes)} nodes, "
                                                   f"update {len(p.update.graph.nodes)} nodes")
        if schedule == "native":
            plan = _native_plan(trainer.config, schedule, "not analysed",
                                "schedule='native': the untransformed program")
            graphs, runtime = {"rollout": programs.rollout, "update": programs.update}, None
        else:
            plan, graphs, runtime = _compile(subject, programs, schedule, memory_budget, strict, options, tune_matmuls,
                                             bitwise, history)
    optimized = copy.copy(trainer)
    optimized.__class__ = optimized_class(type(trainer))
    optimized.plan = plan
    optimized.graphs = graphs
    optimized._engine = runtime
    optimized._reference_engine = _reference_engine(trainer, runtime)
    optimized.pass_history = history
    return optimized


def _reference_engine(trainer, engine) -> ReuseEngine | None:
    """Reweight's loss heads run the trainer's loss, its KL reference included, once per provisional advantage. A
    reference that is a module of its own (full fine-tuning's frozen copy; LoRA's is the backbone with adapters
    disabled, whose calls the backbone's engine sees) gets an engine of its own, so that it runs once per kept row."""
    reference = getattr(trainer, "reference", None)
    if engine is None or not isinstance(engine.schedule, Reweight) or not isinstance(reference, torch.nn.Module):
        return None
    return ReuseEngine(reference, engine.schedule, {})


def _on_weights(trainer, backbone, trainable):
    """``trainer`` seen running ``backbone`` with ``trainable`` weights (its generators and config shared)."""
    view = copy.copy(trainer)
    view.__dict__.update(backbone=backbone, trainable=trainable)
    return view


@dataclass(frozen=True)
class _Options:
    """What the caller asked of the auto planner (what it plans for) and of the runtime."""

    memory_limit: int | None
    samples_per_step: int | None
    device: object
    per_block: bool | None = None  # how the runtime runs Retain (see optimize)


def _compile(trainer, programs, requested: str, memory_budget, strict: bool, options: _Options,
             tune_matmuls: bool, bitwise: bool, history: passes.PassHistory):
    """Run the analyses in order; where one finds no valid reuse, the plan is native and says why."""
    config = trainer.config
    graphs = {"rollout": programs.rollout, "update": programs.update}
    shared = history.analyse("detect_shared_backbone", "rollout + update", passes.detect_shared_backbone,
                             programs.rollout, programs.update,
                             found=lambda s: f"{len(s.pairs)} shared call(s), {s.nodes} nodes")
    unshared = "; ".join(f"update call {i} not shared: {why}" for i, why in shared.unshared)
    if not shared.found:
        reason = "no reusable backbone call: " + (unshared or "nothing found")
        return _native_plan(config, requested, unshared or "no backbone call", reason), graphs, None
    pair = shared.pairs[0]
    validity = history.analyse("check_validity", "rollout + update", passes.check_validity, programs.rollout,
                               programs.update, pair, strict=strict, numerics_only=shared.numerics_only,
                               found=lambda v: "reusable" if v.reusable else "refused: " + "; ".join(v.reasons))
    findings = tuple(f"{f.kind}: {f.message}" for f in validity.findings)
    description = (f"update call {pair[0]} recomputes rollout call {pair[1]} ({shared.nodes} aten nodes, "
                   f"{len(shared.parameters)} parameters, batch of {shared.layout.segments} segment(s))"
                   + (f"; {unshared}" if unshared else ""))
    if not validity.reusable:
        reason = "reuse refused: " + "; ".join(validity.reasons)
        return _native_plan(config, requested, description, reason, findings), graphs, None
    if bitwise and shared.numerics_only:
        reason = ("reuse refused: bitwise=True, and the rollout's call and the update's run different operators "
                  "(they match only modulo casts or kernel flags), so native's own update rounds differently")
        return _native_plan(config, requested, description, reason, findings), graphs, None
    linearity = history.analyse("check_linearity", "update", passes.check_linearity, programs.update,
                                found=lambda lin: "affine" if lin.affine else f"not affine: {lin.reason}")
    refusal = _reweight_refusal(linearity, shared.numerics_only, bitwise)
    steps, cost = (), None
    if requested == "auto":
        cost = _cost_plan(trainer, options, refusal, linearity)
        auto = cost["auto"]
        use_reweight, steps = auto.runs == "reweight", auto.steps if auto.runs == "retain" else ()
        if bitwise:  # the eager graph is kept whole or not at all
            steps = tuple(a if a.kind is Action.RECOMPUTE or (a.kind is Action.RETAIN and a.fraction == 1)
                          else StepAction(a.step, Action.RECOMPUTE) for a in steps)
        choice = (f"auto: planned on {cost.device} within {cost_planner.format_bytes(cost.budget)}: {auto.note}; predicted "
                  + ", ".join(f"{e.schedule} {cost.speedup(e.schedule):.2f}x" + ("" if e.fits else " (does not fit)")
                              for e in cost.estimates[:3]))
        if auto.runs == "native":
            return _native_plan(config, requested, description, choice, findings), graphs, None
    elif requested == "reweight" and refusal is not None:
        use_reweight, choice = False, refusal + " -> Retain"
    else:
        use_reweight, choice = requested == "reweight", f"schedule={requested!r} requested"
    if use_reweight:
        # Traced on first access: a second trace of the backbone, forward and backward, that only inspection reads.
        graphs = Graphs(rollout=functools.partial(passes.capture_provisional, trainer), update=programs.update,
                        rollout_traced=programs.rollout)
        steps = _steps(config, StepAction(0, Action.REWEIGHT))
        plan = Plan(Schedule.REWEIGHT, requested, steps, REUSE_RULE, description, "nothing", findings,
                    _describe_linearity(linearity), BUFFERS, choice, cost, EXACTNESS["reweight"])
        return plan, graphs, _engine(trainer, Reweight(bool(linearity.advantage_free)), steps, tune_matmuls, history)
    need = history.analyse("prune_gradient_need", "update", passes.prune_gradient_need, programs.update, pair[0],
                           shared.layout.segments, found=lambda n: f"pruned segments {list(n.pruned)}")
    rewritten = history.analyse("rewrite_for_retain", "rollout + update", passes.rewrite_for_retain,
                                programs.rollout, programs.update, pair,
                                found=lambda r: f"inserted {', '.join(r.inserted)}; removed {len(r.removed)}")
    graphs = {"rollout": rewritten.rollout, "update": rewritten.update,
              "rollout_traced": programs.rollout, "update_traced": programs.update}
    pruned = (f"segment(s) {list(need.pruned)} of the batch carry no gradient (e.g. a detached CFG branch): "
              "the rollout keeps nothing for them") if need.pruned else "nothing"
    partial = memory_budget is not None and memory_budget < 1
    steps = _steps(config, StepAction(0, Action.RETAIN, fraction=memory_budget if partial else 1.0), steps)
    if bitwise:
        pruned = "nothing (bitwise: the eager graph is kept whole)"
    per_block = options.per_block
    if per_block is None:  # under FSDP2 per block, unless the plan keeps part of the partition on gathered weights
        per_block = trainer.sync.kind == "fsdp" and not bitwise and (
            cost["auto"].per_block if cost is not None else not partial)
    if per_block and not bitwise:
        choice += "; run per transformer block (runtime.regional)"
        if any(a.fraction < 1 for a in steps if a.keeps):
            choice += ", a step retained at a fraction keeping that fraction of the blocks"
    plan = Plan(Schedule.RETAIN, requested, steps, REUSE_RULE, description, pruned, findings,
                _describe_linearity(linearity), "none", choice, cost, EXACTNESS["bitwise" if bitwise else "retain"])
    kept = BitwiseRetain() if bitwise else Retain(shared.layout.segments, need.pruned)
    return plan, graphs, _engine(trainer, kept, steps, tune_matmuls, history, per_block)


def _reweight_refusal(linearity, numerics_only: bool, bitwise: bool) -> str | None:
    """Why Reweight cannot give the native gradient here (None if it can)."""
    if bitwise:
        return "Reweight refused: bitwise=True, and its gradient is a combination of provisional gradients"
    if not linearity.affine:
        return f"Reweight refused: the loss is not affine in the advantages ({linearity.reason})"
    if not linearity.row_mean:
        return "Reweight refused: the loss sums over the micro-batch's rows; Reweight reads a mean"
    if numerics_only:
        return "Reweight refused: the update's numerics differ from the rollout's (casts or kernels), so ratio != 1"
    return None


def _cost_plan(trainer, options: _Options, refusal, linearity):
    """The planner's predictions for this trainer on the device it runs on (or the one named)."""
    config = trainer.config
    samples = options.samples_per_step or config.train_batch_size * config.gradient_accumulation_steps
    samples = max(samples, config.group_size)
    free = bool(linearity.advantage_free)
    scenario = trainer_scenario(trainer, samples, reweight_refusal=refusal, advantage_free=free,
                                world_size=trainer.sync.world_size,
                                sharding="fsdp" if trainer.sync.kind == "fsdp" else "ddp",
                                buffers=reweight_buffers(config, free, samples))
    device = options.device
    if device is None:
        device = live_device(trainer.device.type)
    elif isinstance(device, str):
        device = get_device(device)
    return cost_planner.plan(scenario, device, options.memory_limit)


BUFFERS = ("one provisional gradient per kept row and trained step (per basis cotangent: the policy term, and the "
           "advantage-free terms where the loss has them), each used by at most one call with grad")


def _describe_linearity(linearity) -> str:
    if not linearity.affine:
        return f"not affine in the advantages: {linearity.reason} (Reweight would be refused)"
    free = ", ".join(linearity.advantage_free) or "none"
    ties = ", ".join(linearity.ties) or "none"
    return f"affine in the advantages at ratio 1 (ties proven: {ties}; advantage-free terms: {free})"


_HOW = {Action.RETAIN: "the rollout keeps its activations for the update's calls",
        Action.REWEIGHT: "the rollout backpropagates it at provisional advantages; the update's calls add the "
                         "combination their cotangents call for",
        Action.OFFLOAD: "the rollout keeps its activations in host memory for the update's calls",
        Action.RECOMPUTE: "retaining it does not fit the memory budget: the update recomputes it"}
_TRAINED = {"first": "trained by every sample", "random": "trained by the samples that draw it",
            "window": "trained when inside the SDE window"}


def _steps(config, default: StepAction, planned: tuple[StepAction, ...] = ()) -> tuple[StepAction, ...]:
    """Per denoising step; ``planned`` is the planner's action per trained step, by position, ``default`` the
    action of the others."""
    steps, position = [], 0
    for i in range(config.num_steps):
        if config.trained_steps == "first" and i >= config.num_trained_steps:
            steps.append(StepAction(i, Action.NO_GRAD, "never trained: the rollout runs it without grad"))
            continue
        this = planned[position] if position < len(planned) else default
        position += 1
        reason = (f"the rollout keeps a fraction {this.fraction:.2f} of its activations, the backward recomputes the "
                  "rest") if this.fraction < 1 else _HOW[this.kind]
        if this.kind is not Action.RECOMPUTE:
            reason += ", served to each call verified to recompute it"
        steps.append(StepAction(i, this.kind, f"{_TRAINED[config.trained_steps]}: {reason}", this.fraction))
    return tuple(steps)
