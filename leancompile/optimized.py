"""The optimized trainer: the user's trainer class with its backbone calls routed through the reuse engine.

:func:`leancompile.optimize` returns a shallow copy of the trainer whose class is ``Optimized<Name>``, this mixin
placed before the trainer's own class. During a step every ``self.backbone(...)`` call goes through the
:class:`~leancompile.runtime.engine.ReuseEngine`, which serves a call from the rollout only where it verifies it;
the overrides below only tell the engine's policy which rollout calls to keep (the plan's trained steps) and, for
Reweight, run the trainer's own loss head on each kept step. The update, its backward and its optimizer steps are
the trainer's own. Where the plan came from auto, the program's measured time is compared with native's after the
first steps alternately with the program and natively (:mod:`leancompile.runtime.auto_trial`: a step is the
trial's cycle), and the trainer runs natively from then on where the program is not faster.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from .plan import AUTO, Plan
from .backbones.routing import CalledAs, running
from .runtime import auto
from .runtime.auto_trial import Trial, Verdict
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
    # auto's trial of the program against native over whole steps (runtime.auto_trial), until its verdict
    _trial: Trial | None = None
    _verdict: Verdict | None = None
    # what builds auto's runner-up (plan, graphs, engine, reference engine), tried where the pick measured no faster
    _runner_up = None
    _kept_now: list = ()

    def explain(self) -> str:
        from .explain import explain_text

        return explain_text(self)

    def step(self, prompts):
        # auto's plan, tried in one process (ranks would each reach their own verdict)
        if self._trial is None and self._verdict is None and self._engine is not None and auto.AUTO_FLOOR > 0 \
                and self.plan.requested == AUTO and self.sync.world_size == 1:
            self._trial = Trial()
        if self._trial is not None:
            self._try()
        engine, reference = self._engine, self._reference_engine
        if engine is None or (self._trial is not None and self._trial.native):
            stats = {**no_stats(), **self._natively(prompts), "trying": self._trial is not None}
            if self._trial is not None:
                self._trial.end(auto.now())
            if self._verdict is not None and not self._verdict.keeps:  # auto measured native faster: it said so
                stats["stopped"] = str(self._verdict)
            return stats
        gathers = self.sync.gathers  # FSDP2's gather of the whole weights comes before the trainer's own step
        try:
            with contextlib.ExitStack() as routes:
                backbone, _ = routes.enter_context(self.sync.whole_weights(self))
                routes.enter_context(running(self, CalledAs(backbone, engine)))
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
        stats["trying"] = self._trial is not None
        if self._trial is not None:
            self._trial.end(auto.now())
        self.graphs.update(runtime_graphs(engine))
        return stats

    def _try(self) -> None:
        """auto's trial: a step begins, the one before it ends; at the verdict the program keeps serving or,
        measured no faster, the trainer runs natively from now on and says why."""
        now = auto.now()
        verdict = self._trial.rollout(now, self._engine.compiled_seconds)
        if verdict is None:
            return
        self._trial, self._verdict = None, verdict
        if verdict.keeps:
            return
        if self._runner_up is not None:  # the planner's next best, tried in turn
            build, self._runner_up = self._runner_up, None
            self.plan, graphs, self._engine, self._reference_engine = build()
            self.graphs.update(graphs)
            warnings.warn(f"leancompile.optimize: {verdict.measured()}: the runner-up {self.plan.schedule} is tried "
                          "next", RuntimeWarning, stacklevel=3)
            self._trial, self._verdict = Trial(), None
            self._trial.rollout(now, 0.0)  # this step is its first cycle, which compiles
            return
        warnings.warn(f"leancompile.optimize: {verdict}", RuntimeWarning, stacklevel=3)
        self._engine = self._reference_engine = None  # each step freed what its engine kept

    def _natively(self, prompts) -> dict:
        """The trainer's own step, no call routed to an engine (auto's native steps, and after its fallback)."""
        engines = self._engine, self._reference_engine
        self._engine = self._reference_engine = None
        try:
            return super().step(prompts)
        finally:
            self._engine, self._reference_engine = engines

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
