"""TRL's ``GRPOTrainer`` under ``schedule="reweight"``: its own loss handed to the wrapped model as the provisional
head, right after each rollout's old log-probabilities are computed.

::

    model = leancompile.wrap(model, schedule="reweight")
    trainer = GRPOTrainer(model=model, args=GRPOConfig(..., num_iterations=2), ...)
    leancompile.integrations.trl.reweight(trainer)
    trainer.train()

With ``num_iterations > 1`` TRL computes the old log-probabilities with a forward without grad over the
generation batch (in ``_generate_and_score_completions``): the wrapped model keeps those calls. :func:`reweight`
then runs the trainer's own ``compute_loss`` on those rows at one advantage for every row (1, and 0 for the KL
term), calling the model as the update does; the kept calls are answered with their kept outputs, each row's
gradients are computed once, and the update's first iteration (the rows shuffled, in micro-batches) is served
from them. Its later iterations follow an optimizer step and recompute. ``stats()`` on the wrapped module says
what was served.

TRL's log-probabilities are float32 whatever the model's dtype, so the served gradient is native's to float32's
precision (:mod:`leancompile.runtime.reweight`).
"""
from __future__ import annotations

import copy
import functools

import torch

from ..wrapping.wrapped import Wrapped

# What ``compute_loss`` writes besides the loss (logged metrics, the adaptive entropy controller): the heads' runs
# are not training steps, so the trainer gets these back as they were.
_TRAINER_STATE = ("_metrics", "_entropy_window_stats", "entropy_coef", "_last_world_entropy")


def reweight(trainer):
    """Hand ``trainer``'s loss to its wrapped model as the provisional head after each rollout; returns ``trainer``.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or subclass) whose model, or a submodule of it, was wrapped with
            ``leancompile.wrap(..., schedule="reweight")``, configured so that TRL computes old log-probabilities
            (``num_iterations > 1`` with ``gradient_accumulation_steps`` not a multiple of
            ``steps_per_generation * num_iterations``; otherwise nothing runs twice to be saved).
    """
    if not callable(getattr(trainer, "_generate_and_score_completions", None)) or not hasattr(trainer, "model"):
        raise ValueError(f"trainer must be a trl.GRPOTrainer; got {type(trainer).__name__}")
    wrapped = _wrapped_module(trainer.model)
    if wrapped is None:
        raise ValueError("trainer.model is not wrapped: build the trainer on "
                         "model = leancompile.wrap(model, schedule='reweight')")
    if not wrapped.engine.schedule_runtime.advantages:
        raise ValueError("the trainer's model was wrapped with another schedule than Reweight; wrap it with "
                         "schedule='reweight'")
    args = trainer.args
    # TRL's own condition for computing the old log-probabilities (else it reuses the update's, detached)
    generate_every = args.steps_per_generation * trainer.num_iterations
    if args.gradient_accumulation_steps % generate_every == 0 and not (
            trainer.use_vllm and getattr(trainer, "vllm_importance_sampling_correction", False)):
        raise ValueError(f"GRPOConfig: gradient_accumulation_steps={args.gradient_accumulation_steps} is a multiple "
                         f"of steps_per_generation * num_iterations = {generate_every}, so TRL computes no old "
                         "log-probabilities: no forward runs twice, and Reweight has nothing to serve; set "
                         "num_iterations >= 2 with gradient_accumulation_steps <= steps_per_generation")
    generate_and_score = trainer._generate_and_score_completions

    @functools.wraps(generate_and_score)
    def generating_then_reweighting(*args, **kwargs):
        batch = generate_and_score(*args, **kwargs)
        # Evaluation generates too, in eval mode, and trains nothing
        if trainer.model.training and batch.get("old_per_token_logps") is not None:
            wrapped.provisional(functools.partial(_loss_at, trainer, batch))
        return batch

    trainer._generate_and_score_completions = generating_then_reweighting
    return trainer


def _loss_at(trainer, batch: dict, advantage: float) -> torch.Tensor:
    """The trainer's loss on the generation batch's rows with ``advantage`` for every row, the trainer's state left
    as it was."""
    saved = {name: copy.deepcopy(trainer.__dict__[name]) for name in _TRAINER_STATE if name in trainer.__dict__}
    try:
        advantages = torch.full_like(batch["advantages"], advantage)
        return trainer.compute_loss(trainer.model, {**batch, "advantages": advantages})
    finally:
        trainer.__dict__.update(saved)


def _wrapped_module(model: torch.nn.Module) -> Wrapped | None:
    """``model`` or its first submodule wrapped by :func:`leancompile.wrap` (None: none is)."""
    return next((module for module in model.modules() if isinstance(module, Wrapped)), None)
