"""``leancompile.optimize(trainer)``: run the passes, choose a schedule, return the rewritten trainer."""
from __future__ import annotations

import copy

from . import passes
from .plan import Plan, StepAction
from .protocol import check_protocol
from .runtime.retain import RetainRuntime, swapped_backbone

SCHEDULES = ("auto", "retain", "reweight", "native")


class _Optimized:
    """Mixed in before the trainer's own class: overrides the protocol's call sites and loop hooks."""

    plan: Plan
    graphs: dict
    _runtime: RetainRuntime | None

    def explain(self) -> str:
        from .explain import explain_text

        return explain_text(self)

    def step(self, prompts):
        runtime = self._runtime
        if runtime is None:
            return super().step(prompts)
        runtime.state = type(runtime.state)()
        try:
            stats = super().step(prompts)
        finally:
            runtime.state.kept.clear()  # nothing outlives its GRPO step
        records = runtime.state.records
        stats.update(
            reused_micro_steps=sum(r.action == "reuse" for r in records),
            recomputed_micro_steps=sum(r.action == "recompute" for r in records),
            retained_bytes=runtime.state.retained_bytes,
        )
        self.last_micro_steps = list(records)
        if runtime.partitioned.forward_graph is not None:
            self.graphs["backbone_forward"] = runtime.partitioned.forward_graph
            self.graphs["backbone_backward"] = runtime.partitioned.backward_graph
        return stats

    def sde_mask(self):
        mask = super().sde_mask()
        if self._runtime is not None:
            # Epoch 0's trained steps come from the ``steps`` generator right after the window, exactly where the
            # native update would draw them; rewards cannot change them, so they are known before the rollout.
            self._runtime.state.schedule = super().trained_step_schedule(self._num_samples, mask)
        return mask

    def rollout(self, prompts):
        prompts = list(prompts)
        self._num_samples = len(prompts) * self.config.group_size
        return super().rollout(prompts)

    def trained_step_schedule(self, num_samples, sde_steps):
        state = self._runtime.state if self._runtime is not None else None
        if state is not None and state.schedule is not None:
            schedule, state.schedule = state.schedule, None
            return schedule
        if state is not None:
            state.epoch += 1
            state.batch_rows = None
        return super().trained_step_schedule(num_samples, sde_steps)

    def rollout_velocity(self, step, rows, x, sigma, cond):
        runtime = self._runtime
        if runtime is None or not runtime.needs_retention(step, rows):
            return super().rollout_velocity(step, rows, x, sigma, cond)
        with swapped_backbone(self, runtime.kept_call(step, rows)):
            return super().rollout_velocity(step, rows, x, sigma, cond)

    def micro_step(self, rollout, advantages, rows, steps):
        runtime = self._runtime
        if runtime is not None:
            state = runtime.state
            if state.batch_rows is not rows:
                state.batch = state.batch + 1 if state.batch_rows is not None else 0
                state.batch_rows, state.slot = rows, 0
            else:
                state.slot += 1
        return super().micro_step(rollout, advantages, rows, steps)

    def train_velocity(self, micro):
        runtime = self._runtime
        if runtime is None:
            return super().train_velocity(micro)
        refusal = runtime.reuse_refusal(micro)
        if refusal is not None:
            runtime.record("recompute", refusal)
            return super().train_velocity(micro)
        runtime.record("reuse", "same weights, inputs and mode as the rollout")
        with swapped_backbone(self, runtime.reused_call(micro)):
            return super().train_velocity(micro)

    def backward(self, loss):
        super().backward(loss)
        if self._runtime is not None:
            self._runtime.collect()

    def optimizer_step(self):
        if self._runtime is not None:
            self._runtime.flush()
        super().optimizer_step()


_CLASSES: dict[type, type] = {}


def _optimized_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Optimized{cls.__name__}", (_Optimized, cls), {})
    return _CLASSES[cls]


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
        schedule: ``"auto"`` (the fastest valid schedule), ``"retain"``, or ``"native"`` (the untransformed
            program). ``"reweight"`` is recognised but not available in this version.
        memory_budget: the fraction (0, 1] of the backbone's saved activations the partition may keep; below 1
            the min-cut partitioner recomputes the rest in the backward.
        strict: refuse reuse when the rollout's numerics differ from the update's (precision or casts).

    Returns:
        The optimized trainer, with ``.plan``, ``.graphs`` and ``.explain()``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if schedule == "reweight":
        raise NotImplementedError("schedule='reweight' is not available yet; use 'retain', 'auto' or 'native'")
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
        plan, graphs, runtime = _compile_retain(trainer, programs, schedule, memory_budget, strict)
    optimized = copy.copy(trainer)
    optimized.__class__ = _optimized_class(type(trainer))
    optimized.plan = plan
    optimized.graphs = graphs
    optimized._runtime = runtime
    return optimized


def _compile_retain(trainer, programs, requested: str, memory_budget, strict: bool):
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
    need = passes.prune_gradient_need(programs.update, pair[0], shared.layout.segments)
    rewritten = passes.rewrite_for_retain(programs.rollout, programs.update, pair)
    graphs = {"rollout": rewritten.rollout, "update": rewritten.update,
              "rollout_traced": programs.rollout, "update_traced": programs.update}
    runtime = RetainRuntime(trainer.backbone, trainer.trainable, shared.layout.segments, need.needed,
                            memory_budget or 1.0, verify_inputs=not shared.cast_only)
    pruned = (f"segment(s) {list(need.pruned)} of the batch carry no gradient (e.g. a detached CFG branch): "
              "run without grad, not retained") if need.pruned else "nothing"
    plan = Plan("retain", requested, _retain_steps(config), _reuse_window(config), description, pruned, findings,
                _describe_linearity(passes.check_linearity(programs.update)))
    return plan, graphs, runtime


def _describe_linearity(linearity) -> str:
    if not linearity.affine:
        return f"not affine in the advantages: {linearity.reason} (Reweight would be refused)"
    free = ", ".join(linearity.advantage_free) or "none"
    ties = ", ".join(linearity.ties) or "none"
    return f"affine in the advantages at ratio 1 (ties proven: {ties}; advantage-free terms: {free})"


def _retain_steps(config) -> tuple[StepAction, ...]:
    steps = []
    for i in range(config.num_steps):
        if config.trained_steps == "first" and i >= config.num_trained_steps:
            steps.append(StepAction(i, "no-grad", "never trained: the rollout runs it without grad"))
        else:
            trained = {"first": "trained by every sample", "random": "trained by the samples that draw it",
                       "window": "trained when inside the SDE window"}[config.trained_steps]
            steps.append(StepAction(i, "retain", f"{trained}: the rollout keeps its activations for the micro-steps "
                                    "before the first optimizer step; later micro-steps recompute"))
    return tuple(steps)
