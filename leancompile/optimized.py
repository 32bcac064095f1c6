"""The optimized trainer: the user's trainer class with its backbone calls routed through the reuse engine.

:func:`leancompile.optimize` returns a shallow copy of the trainer whose class is ``Optimized<Name>``, this mixin
placed before the trainer's own class. During a step every ``self.backbone(...)`` call goes through the
:class:`~leancompile.runtime.engine.ReuseEngine`, which serves a call from the rollout only where it verifies it;
the overrides below only tell the engine's policy which rollout calls to keep (the plan's trained steps) and, for
Reweight, run the trainer's own loss head on each kept step. The update, its backward and its optimizer steps are
the trainer's own. Where the plan came from auto, the program's measured time is compared with native's after the
first step that served calls (:mod:`leancompile.runtime.auto`), and the trainer runs natively from then on where it
is slower.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from .plan import Plan
from .backbones.routing import CalledAs, running
from .runtime.auto import Watch
from .runtime.engine import ReuseEngine, no_stats
from .protocol import MicroStep


class Optimized:
    """Mixed in before the trainer's own class."""

    plan: Plan
    graphs: dict
    _engine: ReuseEngine | None
    # Reweight, where the KL reference is a module of its own (full fine-tuning): its calls' values, kept by the
    # loss heads (which run the reference once per provisional advantage) and served to the update, verified
    _reference_engine: ReuseEngine | None = None
    _predicted = None  # epoch 0's trained steps (samples, k), predicted before the rollout
    # auto's run-time check of the program against native (runtime.auto), where its plan runs a timed engine
    _watch: Watch | None = None
    _kept_now: list = ()

    def explain(self) -> str:
        from .explain import explain_text

        return explain_text(self)

    def step(self, prompts):
        engine, reference = self._engine, self._reference_engine
        if engine is None:
            stats = {**no_stats(), **super().step(prompts)}
            if self._watch is not None:  # auto measured the program slower than native: it said so
                stats["stopped"] = self._watch.verdict
            return stats
        if self._watch is None and getattr(engine, "timed", False):  # auto's plan in one process (schedules)
            self._watch = Watch(self.trainable)
        watch = self._watch
        gathers = self.sync.gathers  # FSDP2's gather of the whole weights comes before the trainer's own step
        try:
            with contextlib.ExitStack() as routes:
                backbone, _ = routes.enter_context(self.sync.whole_weights(self))
                call = engine if watch is None else functools.partial(_watched, watch, engine, backbone)
                routes.enter_context(running(self, CalledAs(backbone, call)))
                if reference is not None:  # its calls recorded in the engine's log (see api._reference_engine)
                    routes.enter_context(running(self, CalledAs(self.reference, reference), "reference"))
                stats = super().step(prompts)
            stats["weight_gathers"] = self.sync.gathers - gathers
        finally:
            self.last_calls = list(engine.log.records)
            extra = engine.end_step()
            if reference is not None:
                extra["check_seconds"] += reference.end_step()["check_seconds"]
            self._predicted = None
        stats.update(extra)
        self.graphs.update(runtime_graphs(engine))
        if watch is not None and watch.weigh(self.last_calls, extra["check_seconds"]) is not None:
            stats["stopped"] = watch.verdict
            warnings.warn(f"leancompile.optimize: {watch.verdict}", RuntimeWarning, stacklevel=2)
            self._engine = self._reference_engine = None
        return stats

    def rollout(self, prompts):
        self._num_samples = len(list(prompts)) * getattr(self, "samples_per_prompt", self.config.group_size)
        return super().rollout(prompts)

    def sde_mask(self):
        mask = super().sde_mask()
        if self._engine is not None:
            self._predicted = self._predict_schedule(mask)
        return mask

    def _predict_schedule(self, mask):
        """The update's first trained-step draw, made now on copies of the generators' states (so the update draws
        the same numbers itself). A wrong prediction only keeps calls the update does not ask for."""
        generators = getattr(self, "generators", {})
        states = {name: g.get_state() for name, g in generators.items()}
        try:
            return super().trained_step_schedule(self._num_samples, mask)
        finally:
            for name, g in generators.items():
                g.set_state(states[name])

    def _step_action(self, step: int, rows: torch.Tensor):
        """The plan's action for the rollout's call at ``step`` over ``rows`` (None: not kept)."""
        predicted = self._predicted
        if predicted is None or not bool((predicted[rows.cpu()] == step).any()):
            return None
        action = self.plan.steps[step]
        return action if action.keeps else None

    def rollout_velocity(self, step, rows, x, sigma, cond):
        action = self._step_action(step, rows) if self._engine is not None else None
        if action is None:
            self._kept_now = ()
            if self._engine is None:
                return super().rollout_velocity(step, rows, x, sigma, cond)
            with self._engine.policy.passing():  # a step no update trains: nothing to keep, nothing to look up
                return super().rollout_velocity(step, rows, x, sigma, cond)
        with self._engine.policy.keeping(action) as kept:
            velocity = super().rollout_velocity(step, rows, x, sigma, cond)
        self._kept_now = kept
        return velocity

    def rollout_step(self, step, rows, x, cond, sde):
        x_next, log_prob = super().rollout_step(step, rows, x, cond, sde)
        if self._kept_now and self._engine.schedule_runtime.advantages:
            self._provisional(step, rows, x, x_next, log_prob, cond)
        self._kept_now = ()
        return x_next, log_prob

    def _provisional(self, step, rows, x, x_next, log_prob, cond) -> None:
        """Reweight: the trainer's own loss head on this step's kept output for the rows that train it, at
        the schedule's provisional advantages."""
        trained = (self._predicted[rows.cpu()] == step).any(dim=1).nonzero().flatten().to(x.device)
        sigmas = self.sigmas

        def head(advantage: float):
            micro = MicroStep(rows=rows[trained], steps=torch.full_like(trained, step), x=x[trained],
                              prev_sample=x_next[trained], sigma=sigmas[step].expand(len(trained)),
                              sigma_next=sigmas[step + 1].expand(len(trained)), cond=cond.index(trained),
                              log_prob_old=log_prob[trained],
                              advantages=torch.full((len(trained),), advantage, dtype=x.dtype, device=x.device))
            return lambda: super(Optimized, self).micro_step_loss(micro)[0]

        with torch.enable_grad(), contextlib.ExitStack() as reference:
            if self._reference_engine is not None:  # the heads' reference calls run once; the update's are served
                reference.enter_context(self._reference_engine.answering_with_leaves())
            self._engine.provisional([head(a) for a in self._engine.schedule_runtime.advantages])

    def optimizer_step(self):
        super().optimizer_step()
        if self._engine is not None:
            self.sync.weights_changed()  # FSDP2: the whole weights a rewritten step runs on are gathered anew


def _watched(watch: Watch, engine: ReuseEngine, backbone, *args, **kwargs):
    return watch.call(engine, backbone, args, kwargs)


def runtime_graphs(engine: ReuseEngine) -> dict:
    """The graphs the engine traced while running: the per-row backbone's forward and backward."""
    graphs = {}
    for fraction, rowwise in engine.rowwise.items():
        suffix = "" if fraction == 1.0 else f"@{fraction:.2f}"
        if rowwise.forward_graph is not None:
            graphs["backbone_forward" + suffix] = rowwise.forward_graph
        if rowwise.backward_graph is not None:
            graphs["backbone_backward" + suffix] = rowwise.backward_graph
    return graphs


_CLASSES: dict[type, type] = {}


def optimized_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Optimized{cls.__name__}", (Optimized, cls), {})
    return _CLASSES[cls]
