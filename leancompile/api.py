"""``leancompile.optimize(trainer)``: run the passes, choose a schedule, return the rewritten trainer."""
from __future__ import annotations

import copy
import dataclasses

import torch

from . import passes
from .cost import planner as cost_planner
from .cost.devices import get_device, live_device
from .cost.scenario import reweight_buffers, trainer_scenario
from .optimized import optimized_class
from .plan import AUTO, Action, Plan, Schedule, SharedCall, StepAction
from .protocol import check_protocol
from .runtime import calibration
from .runtime.engine import ReuseEngine
from .request import Request
from .schedules import EXACTNESS, SCHEDULES, Analyses, estimators, refusals


REUSE_RULE = ("per backbone call, verified when it happens: every row's inputs bitwise equal to a kept row's, the "
              "same weights (version counters; a fingerprint once per update phase), training flags, adapters and "
              "autocast; anything else recomputes natively (stats: recompute_reasons)")


def _native_plan(config, requested: str, reason: str, **analyses) -> Plan:
    steps = tuple(StepAction(i, Action.NATIVE, reason) for i in range(config.num_steps))
    return Plan(Schedule.NATIVE, requested, steps, reason, exactness=EXACTNESS[Schedule.NATIVE], **analyses)


def optimize(trainer, schedule: str = "auto", memory_budget: float | None = None, strict: bool = False,
             memory_limit: int | None = None, samples_per_step: int | None = None, device=None,
             tune_matmuls: bool = True, bitwise: bool = False, per_block: bool | None = None,
             verify: str = "values"):
    """Return a trainer that runs the same GRPO step as ``trainer`` with the redundant backbone forward removed.

    Args:
        trainer: an object satisfying the trainer protocol (:mod:`leancompile.protocol`), e.g. a native
            ``FlowGRPOTrainer`` or ``DanceGRPOTrainer``. The result shares its weights, optimizer and generators.
        schedule: ``"auto"`` (the fastest valid schedule), ``"retain"`` (keep the rollout's activations for the
            update's backward), ``"offload"`` (keep them in host memory), ``"reweight"`` (backpropagate during the
            rollout with a provisional advantage and correct once the advantages are known), or ``"native"`` (the
            untransformed program); the schedules are :mod:`leancompile.schedules`' registry. Where the requested
            schedule is not valid the plan falls back (Reweight and Offload to Retain, Retain to native) and says
            why.
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
        per_block: run Retain or Reweight per transformer block (:mod:`leancompile.runtime.regional`: the
            module around the blocks runs natively, each block's calls are served inside a verified backbone
            call), which keeps FSDP2's per-block gathers and reduce-scatters; a step the plan retains at a
            fraction f (or ``memory_budget``) runs each block's partition at activation budget f. ``None``: per
            block under FSDP2 (``parallel="fsdp"``) unless auto's plan prices Retain's whole call on the gathered
            weights, the whole call otherwise. Bitwise Retain runs the whole call.
        verify: as in :func:`leancompile.wrap`: ``"values"`` compares a digest of the weights' values at every
            answer, ``"versions"`` their version counters alone (for a reward or callback known not to write the
            weights through ``.data``).

    Returns:
        The optimized trainer, with ``.plan``, ``.graphs``, ``.pass_history`` (every pass run, at compile time
        and when the per-row program compiles at the first step) and ``.explain()``.
    """
    request = Request(schedule, "optimize", memory_budget, strict, memory_limit, samples_per_step, device,
                      per_block, tune_matmuls, bitwise, verify=verify)
    check_protocol(trainer)
    history = passes.PassHistory()
    # Traced and analysed on the whole weights' shapes (FSDP2: fake tensors, nothing gathered; trainers.parallel).
    with trainer.sync.analysis_weights(trainer) as (backbone, trainable):
        subject = trainer if backbone is trainer.backbone else _on_weights(trainer, backbone, trainable)
        programs = history.analyse("capture", "trainer", passes.capture, subject,
                                   found=lambda p: f"rollout {len(p.rollout.graph.nodes)} nodes, "
                                                   f"update {len(p.update.graph.nodes)} nodes")
        if schedule == "native":
            plan = _native_plan(trainer.config, schedule, "schedule='native': the untransformed program")
            graphs, runtime, runner_up = {"rollout": programs.rollout, "update": programs.update}, None, None
        else:
            (plan, graphs, runtime), runner_up = _compile(subject, programs, request, history)
    optimized = copy.copy(trainer)
    optimized.__class__ = optimized_class(type(trainer))
    optimized.plan = plan
    optimized.graphs = graphs
    optimized._engine = runtime
    optimized._reference_engine = _reference_engine(trainer, runtime)
    if runner_up is not None:  # built only where auto's trial measures its pick no faster than native
        optimized._runner_up = lambda: _with_reference(trainer, *runner_up())
    optimized.pass_history = history
    return optimized


def _with_reference(trainer, plan: Plan, graphs: dict, engine: ReuseEngine):
    return plan, graphs, engine, _reference_engine(trainer, engine)


def _reference_engine(trainer, engine) -> ReuseEngine | None:
    """Reweight's loss heads run the trainer's loss, its KL reference included, once per provisional advantage. A
    reference that is a module of its own (full fine-tuning's frozen copy; LoRA's is the backbone with adapters
    disabled, whose calls the backbone's engine sees) gets an engine of its own, so that it runs once per kept row;
    its calls are recorded in the backbone engine's log, in call order."""
    reference = getattr(trainer, "reference", None)
    if engine is None or not engine.schedule_runtime.advantages or not isinstance(reference, torch.nn.Module):
        return None
    return ReuseEngine(reference, engine.schedule_runtime, {}, log=engine.log, verify=engine.verify)


def _on_weights(trainer, backbone, trainable):
    """``trainer`` seen running ``backbone`` with ``trainable`` weights (its generators and config shared)."""
    view = copy.copy(trainer)
    view.__dict__.update(backbone=backbone, trainable=trainable)
    return view


def _compile(trainer, programs, request: Request, history: passes.PassHistory):
    """Run the analyses in order, choose a schedule from the registry (:mod:`leancompile.schedules`) and build it;
    where the analyses find no valid reuse, the plan is native and says why. Returns ``(plan, graphs, engine)``
    and, under auto, what builds the runner-up (None where there is none)."""
    config, requested = trainer.config, request.schedule
    graphs = {"rollout": programs.rollout, "update": programs.update}
    shared = history.analyse("detect_shared_backbone", "rollout + update", passes.detect_shared_backbone,
                             programs.rollout, programs.update,
                             found=lambda s: f"{len(s.pairs)} shared call(s), {s.nodes} nodes")
    if not shared.found:
        unshared = "; ".join(f"update call {i} not shared: {why}" for i, why in shared.unshared)
        return (_native_plan(config, requested, "no reusable backbone call: " + (unshared or "nothing found")),
                graphs, None), None
    pair = shared.pairs[0]
    validity = history.analyse("check_validity", "rollout + update", passes.check_validity, programs.rollout,
                               programs.update, pair, strict=request.strict, numerics_only=shared.numerics_only,
                               found=lambda v: "reusable" if v.reusable else "refused: " + "; ".join(v.reasons))
    found = dict(shared=SharedCall(*pair, shared.nodes, len(shared.parameters), shared.layout.segments,
                                   shared.unshared), findings=validity.findings)
    if not validity.reusable:
        return (_native_plan(config, requested, "reuse refused: " + "; ".join(validity.reasons), **found), graphs,
                None), None
    if request.bitwise and shared.numerics_only:
        reason = ("reuse refused: bitwise=True, and the rollout's call and the update's run different operators "
                  "(they match only modulo casts or kernel flags), so native's own update rounds differently")
        return (_native_plan(config, requested, reason, **found), graphs, None), None
    linearity = history.analyse("check_linearity", "update", passes.check_linearity, programs.update,
                                found=lambda lin: "affine" if lin.affine else f"not affine: {lin.reason}")
    analyses = Analyses(trainer, programs, shared, linearity, request, history)
    refused = refusals(analyses)
    found.update(linearity=linearity, refusals=refused)
    planned = ()
    if requested == AUTO:
        cost = _cost_plan(trainer, request, refused, linearity)
        auto = cost[AUTO]
        choice = (f"auto: planned on {cost.device} within {cost_planner.format_bytes(cost.budget)}: {auto.note}; "
                  "predicted " + ", ".join(f"{e.schedule} {cost.speedup(e.schedule):.2f}x"
                                           + ("" if e.fits else " (does not fit)")
                                           for e in cost.estimates[:-1] if e.available))
        if auto.runs is Schedule.NATIVE:
            return (_native_plan(config, requested, choice, cost=cost, **found), graphs, None), None
        chosen, planned = auto.runs, auto.steps
        analyses = dataclasses.replace(analyses, cost=cost)
    else:
        chosen, reasons, fallbacks = Schedule(requested), {r.schedule: r for r in refused}, []
        while chosen in reasons:  # a refused schedule falls back to its fallback, and the plan says why
            fallbacks.append(f"{reasons[chosen]} -> {SCHEDULES[chosen].fallback}")
            chosen = SCHEDULES[chosen].fallback
        choice = "; ".join(fallbacks) or f"schedule={requested!r} requested"
        if chosen is Schedule.NATIVE:
            return (_native_plan(config, requested, choice, **found), graphs, None), None

    def build(schedule: Schedule, planned: tuple, choice: str):
        built = SCHEDULES[schedule].build(analyses, planned)
        plan = Plan(schedule, requested, built.steps, choice + (f"; {built.runs}" if built.runs else ""), **found,
                    pruned=built.pruned, reuse=REUSE_RULE, buffers=built.buffers, cost=analyses.cost,
                    exactness=built.exactness)
        return plan, built.graphs, built.engine

    runner_up = _runner_up(analyses.cost, chosen) if requested == AUTO else None
    if runner_up is None:
        return build(chosen, planned, choice), None
    predicted = f"{runner_up.runs} ({analyses.cost.speedup(runner_up.schedule):.2f}x predicted)"
    return (build(chosen, planned, f"{choice}; runner-up {predicted}, tried where auto's trial measures {chosen} no "
                                   "faster than native"),
            lambda: build(runner_up.runs, runner_up.steps, f"{choice}; its trial measured {chosen} no faster than "
                                                           f"native: the runner-up {predicted} runs instead"))


def _runner_up(cost, chosen: Schedule):
    """The estimate auto tries where its trial measures ``chosen`` no faster than native: the fastest predicted one
    that fits, is predicted faster than native and runs another program (Offload runs Retain's, its activations
    elsewhere: no faster where Retain is not); None where there is none."""
    runtime = SCHEDULES[chosen].runtime
    others = [e for e in cost.estimates if e.schedule in SCHEDULES and e.available and e.fits
              and e.runs is not Schedule.NATIVE and SCHEDULES[e.runs].runtime is not runtime
              and cost.speedup(e.schedule) > 1]
    return max(others, key=lambda e: cost.speedup(e.schedule), default=None)


def _cost_plan(trainer, request: Request, refused, linearity):
    """The planner's predictions for this trainer on the device it runs on (or the one named)."""
    config = trainer.config
    samples = request.samples_per_step or config.train_batch_size * config.gradient_accumulation_steps
    samples = max(samples, config.group_size)
    free = bool(linearity.advantage_free)
    scenario = trainer_scenario(trainer, samples, refusals=refused, advantage_free=free,
                                world_size=trainer.sync.world_size,
                                sharding="fsdp" if trainer.sync.kind == "fsdp" else "ddp",
                                buffers=reweight_buffers(config, free, samples))
    device = request.device
    # The per-row program's costs are measured where the trainer runs; a plan for another device (a named one's
    # datasheet) prices it as eager, and so does a data-parallel one, whose ranks would measure apart and could
    # plan apart.
    here = (device is None or device in ("live", trainer.device.type)) and trainer.sync.world_size == 1
    if device is None:
        device = live_device(trainer.device.type)
    elif isinstance(device, str):
        device = get_device(device)
    return cost_planner.plan(scenario, device, request.memory_limit, estimators=estimators(),
                             overheads=calibration.overheads(trainer.device.type) if here else None,
                             run_steps=getattr(config, "num_grpo_steps", None))

