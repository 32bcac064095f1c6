"""``leancompile.optimize(trainer)``: run the passes, choose a schedule, return the rewritten trainer."""
from __future__ import annotations

import copy
import functools

import torch

from . import passes
from .optimized import optimized_class
from .plan import Plan, StepAction
from .protocol import check_protocol
from .runtime.retain import RetainRuntime
from .runtime.per_sample import trainable_linear_layers
from .runtime.reweight import ReweightRuntime

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


def _reuse_window(config) -> str:
    k = config.num_trained_steps
    per_step = config.gradient_accumulation_steps * config.train_batch_size
    return (f"epoch 0, micro-batches 0..{config.gradient_accumulation_steps - 1} "
            f"({config.gradient_accumulation_steps * k} micro-steps, up to {per_step} samples x {k} trained steps) "
            "reuse the rollout; every later micro-step recomputes: the first optimizer step changes the weights")


def _native_plan(config, requested: str, shared: str, reason: str, findings=()) -> Plan:
    steps = tuple(StepAction(i, "native", reason) for i in range(config.num_steps))
    return Plan("native", requested, steps, "none", shared, "nothing", tuple(findings))


def optimize(trainer, schedule: str = "auto", memory_budget: float | None = None, strict: bool = False):
    """Return a trainer that runs the same GRPO step as ``trainer`` with the redundant backbone forward removed.

    Args:
        trainer: an object satisfying the trainer protocol (:mod:`leancompile.protocol`), e.g. a native
            ``FlowGRPOTrainer`` or ``DanceGRPOTrainer``. The result shares its weights, optimizer and generators.
        schedule: ``"auto"`` (the fastest valid schedule), ``"retain"`` (keep the rollout's activations for the
            update's backward), ``"reweight"`` (backpropagate during the rollout with a provisional advantage and
            correct once the advantages are known), or ``"native"`` (the untransformed program). Where the
            requested schedule is not valid the plan falls back (Reweight to Retain, Retain to native) and says why.
        memory_budget: the fraction (0, 1] of the backbone's saved activations a Retain partition may keep; below
            1 the min-cut partitioner recomputes the rest in the backward.
        strict: refuse reuse when the rollout's numerics differ from the update's (precision or casts).

    Returns:
        The optimized trainer, with ``.plan``, ``.graphs`` and ``.explain()``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if memory_budget is not None and not 0 < memory_budget <= 1:
        raise ValueError(f"memory_budget must be a fraction in (0, 1] of the saved activations; got {memory_budget!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False; got {strict!r}")
    check_protocol(trainer)
    programs = passes.capture(trainer)
    if schedule == "native":
        plan = _native_plan(trainer.config, schedule, "not analysed", "schedule='native': the untransformed program")
        graphs, runtime = {"rollout": programs.rollout, "update": programs.update}, None
    else:
        plan, graphs, runtime = _compile(trainer, programs, schedule, memory_budget, strict)
    optimized = copy.copy(trainer)
    optimized.__class__ = optimized_class(type(trainer))
    optimized.plan = plan
    optimized.graphs = graphs
    optimized._runtime = runtime
    return optimized


def _compile(trainer, programs, requested: str, memory_budget, strict: bool):
    """Run the passes in order; where one finds no valid reuse, the plan is native and says why."""
    config = trainer.config
    graphs = {"rollout": programs.rollout, "update": programs.update}
    shared = passes.detect_shared_backbone(programs.rollout, programs.update)
    unshared = "; ".join(f"update call {i} not shared: {why}" for i, why in shared.unshared)
    if not shared.found:
        reason = "no reusable backbone call: " + (unshared or "nothing found")
        return _native_plan(config, requested, unshared or "no backbone call", reason), graphs, None
    pair = shared.pairs[0]
    validity = passes.check_validity(programs.rollout, programs.update, pair, strict=strict,
                                     cast_only=shared.cast_only)
    findings = tuple(f"{f.kind}: {f.message}" for f in validity.findings)
    description = (f"update call {pair[0]} recomputes rollout call {pair[1]} ({shared.nodes} aten nodes, "
                   f"{len(shared.parameters)} parameters, batch of {shared.layout.segments} segment(s))"
                   + (f"; {unshared}" if unshared else ""))
    if not validity.reusable:
        reason = "reuse refused: " + "; ".join(validity.reasons)
        return _native_plan(config, requested, description, reason, findings), graphs, None
    linearity = passes.check_linearity(programs.update)
    linear = trainable_linear_layers(trainer.backbone, trainer.trainable)[1]
    use_reweight, choice = _choose_reweight(requested, config, linearity, linear, shared.cast_only)
    if use_reweight:
        # Traced on first access: a second trace of the backbone, forward and backward, that only inspection reads.
        graphs = Graphs(rollout=functools.partial(passes.capture_provisional, trainer), update=programs.update,
                        rollout_traced=programs.rollout)
        accumulate = functools.partial(_accumulators, config, bool(linearity.advantage_free))
        runtime = ReweightRuntime(trainer, shared.layout.segments, accumulate, bool(linearity.advantage_free))
        plan = Plan("reweight", requested, _steps(config, "reweight"), _reuse_window(config), description,
                    "nothing", findings, _describe_linearity(linearity), _describe_buffers(config), choice)
        return plan, graphs, runtime
    need = passes.prune_gradient_need(programs.update, pair[0], shared.layout.segments)
    rewritten = passes.rewrite_for_retain(programs.rollout, programs.update, pair)
    graphs = {"rollout": rewritten.rollout, "update": rewritten.update,
              "rollout_traced": programs.rollout, "update_traced": programs.update}
    runtime = RetainRuntime(trainer.backbone, trainer.trainable, shared.layout.segments, need.needed,
                            memory_budget or 1.0, verify_inputs=not shared.cast_only)
    pruned = (f"segment(s) {list(need.pruned)} of the batch carry no gradient (e.g. a detached CFG branch): "
              "run without grad, not retained") if need.pruned else "nothing"
    plan = Plan("retain", requested, _steps(config, "retain"), _reuse_window(config), description, pruned, findings,
                _describe_linearity(linearity), "none", choice)
    return plan, graphs, runtime


def _choose_reweight(requested: str, config, linearity, linear: bool, cast_only: bool) -> tuple[bool, str]:
    """Whether Reweight runs, and why (or why Retain does)."""
    if requested == "retain":
        return False, "schedule='retain' requested"
    refusal = None
    if not linearity.affine:
        refusal = f"Reweight refused: the loss is not affine in the advantages ({linearity.reason})"
    elif not linearity.row_mean:
        refusal = "Reweight refused: the loss sums over the micro-batch's rows; Reweight reads a mean"
    elif cast_only:
        refusal = "Reweight refused: the update's numerics differ from the rollout's (casts), so ratio != 1"
    if refusal is not None:
        return False, refusal + " -> Retain"
    if requested == "reweight":
        return True, "schedule='reweight' requested"
    if linearity.advantage_free:
        return False, (f"auto: the advantage-free terms ({', '.join(linearity.advantage_free)}) need a second "
                       "backward per trained step in the rollout; Retain needs one")
    if config.sample_batch_size != 1 and not linear:
        return False, ("auto: per-sample gradients of these parameters (not all nn.Linear) cost one backward per "
                       "sample of a rollout micro-batch; Retain needs one per micro-batch")
    return True, ("auto: one backward per trained step in the rollout, then gradient buffers of the trainable "
                  "weights instead of retained activations")


def _accumulators(config, has_free: bool, num_samples: int) -> tuple[bool, str]:
    """Whether this step's Reweight may fold finished samples into per-group moments (see passes.moments)."""
    inactive, bound = passes.clip_never_binds(config, num_samples)
    if not inactive:
        return False, f"per-sample buffers: {bound}"
    tbs, ga = config.train_batch_size, config.gradient_accumulation_steps
    if num_samples > ga * tbs:
        return False, f"per-sample buffers: {num_samples} samples span more than the first optimizer step ({ga} x {tbs})"
    if num_samples > tbs and num_samples % tbs:
        return False, f"per-sample buffers: {num_samples} samples make micro-batches of unequal size ({tbs})"
    per = 1 + has_free
    in_flight = min(config.sample_batch_size or num_samples, num_samples) * per
    folded = in_flight + (num_samples // config.group_size) * (2 + has_free)
    if folded >= num_samples * per:
        return False, (f"per-sample buffers: {num_samples * per} buffers; moments would hold {folded} "
                       "(the rollout runs too many samples at once)")
    return True, f"moment accumulators ({bound}): {folded} buffers instead of {num_samples * per}"


def _describe_buffers(config) -> str:
    bound = passes.advantage_bound(config.adv_unbiased, config.global_std)
    return ("per step: moment accumulators (a constant number of buffers per group) when the advantage clip "
            f"provably never binds (|A| < {bound}) and every sample is trained in equal micro-batches before the "
            "first optimizer step, and the rollout runs fewer samples at once than it holds; otherwise one "
            "buffer per sample (stats: buffer_mode)")


def _describe_linearity(linearity) -> str:
    if not linearity.affine:
        return f"not affine in the advantages: {linearity.reason} (Reweight would be refused)"
    free = ", ".join(linearity.advantage_free) or "none"
    ties = ", ".join(linearity.ties) or "none"
    return f"affine in the advantages at ratio 1 (ties proven: {ties}; advantage-free terms: {free})"


def _steps(config, action: str) -> tuple[StepAction, ...]:
    steps = []
    for i in range(config.num_steps):
        if config.trained_steps == "first" and i >= config.num_trained_steps:
            steps.append(StepAction(i, "no-grad", "never trained: the rollout runs it without grad"))
        else:
            trained = {"first": "trained by every sample", "random": "trained by the samples that draw it",
                       "window": "trained when inside the SDE window"}[config.trained_steps]
            how = ("the rollout keeps its activations for the micro-steps" if action == "retain" else
                   "the rollout backpropagates it at a provisional advantage of 1, corrected for the micro-steps")
            steps.append(StepAction(i, action, f"{trained}: {how} before the first optimizer step; later "
                                    "micro-steps recompute"))
    return tuple(steps)
