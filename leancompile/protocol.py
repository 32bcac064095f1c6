"""The trainer protocol: what :func:`leancompile.optimize` needs from a FlowGRPO-style trainer, as a
:class:`typing.Protocol` with its signatures, and the records a trainer and the engine exchange (:class:`Rollout`,
:class:`MicroStep`).

Nothing LeanGRPO-specific: these are the pieces every such trainer has, named. The native trainers in
:mod:`leancompile.trainers` implement it; a user's trainer can too (subclass ``GRPOTrainer`` and override, or
provide the same members).

Attributes:
    config: with ``num_steps``, ``group_size``, ``train_batch_size``, ``gradient_accumulation_steps``,
        ``num_trained_steps``, ``trained_steps``, ``noise`` and the dtype fields; optionally ``num_grpo_steps``,
        the run's length, over which auto amortises the per-row program's compile.
    backbone: the ``leancompile.backbones.Backbone`` the policy runs; every backbone call goes through
        ``self.backbone(x, sigma, cond)``.
    trainable: the parameters the optimizer updates.
    sync: the :class:`~leancompile.trainers.parallel.GradientSync` of its data-parallel engine (one process:
        the base class, which does nothing).
    sigmas, step_fn, dtype: the sigma schedule, the stochastic step ``step_fn(x, v, sigma, sigma_next, noise_level,
        noise=... | prev_sample=...)`` and the run's dtype.

Methods:
    step(prompts) -> dict: one GRPO step (rollout, advantages, update).
    rollout(prompts), sde_mask(), rollout_step(step, rows, x, cond, sde) -> (x_next, log_prob),
        rollout_velocity(step, rows, x, sigma, cond): the rollout, one denoising step of it, and its backbone call
        site (no grad).
    trained_step_schedule(num_samples, sde_steps), micro_step(rollout, advantages, rows, steps),
        micro_step_loss(micro), train_velocity(micro): the update's schedule, inputs, loss and backbone call site.
        ``micro_step_loss`` is the mean over the micro-batch's rows of a per-row loss (Reweight reads it so).
    reference_velocity(micro), optional: the KL reference's velocity, if the loss computes it through this method
        (``GRPOTrainer``'s does); Reweight then runs the reference once per trained sample and step.
    update(rollout, advantages), backward(loss, sync), optimizer_step(): the update, its backward (``sync``: the
        last before an optimizer step, which completes the gradient across ranks) and optimizer step.
    generators, optional: a dict of ``torch.Generator``; the optimized trainer copies their states to predict epoch
        0's trained steps before the rollout and restores them, so the update draws the same numbers itself.

What the optimized trainer reads at run time is only this: it keeps the rollout's calls at the predicted trained
steps (``sde_mask``, ``trained_step_schedule``, ``rollout_velocity``), runs ``micro_step_loss`` on them for Reweight
(``rollout_step``, ``sigmas``), and verifies every ``backbone`` call by content; the reward function, the
advantages and the config's batching are never read to decide a reuse.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .backbones import Backbone, Conditioning


@dataclass
class Rollout:
    """What the rollout hands to the update. ``latents[:, i]`` is the input of step i, ``latents[:, i + 1]`` its
    output; ``log_probs[:, i]`` the log-prob of that output under the rollout's policy."""

    prompts: list
    cond: Conditioning  # (B, ...)
    latents: torch.Tensor  # (B, S + 1, *latent_shape)
    log_probs: torch.Tensor  # (B, S)
    sigmas: torch.Tensor  # (S + 1,)
    sde_steps: torch.Tensor  # (S,) bool: steps with noise (and a log-prob)
    rewards: torch.Tensor | None = None  # (B,)

    @property
    def num_samples(self) -> int:
        return self.latents.shape[0]

    @property
    def final(self) -> torch.Tensor:
        return self.latents[:, -1]


@dataclass(frozen=True)
class MicroStep:
    """One micro-step of the update: rows of the rollout, each at its own trained step."""

    rows: torch.Tensor  # (b,) sample indices into the rollout
    steps: torch.Tensor  # (b,) step index of each row
    x: torch.Tensor
    prev_sample: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    cond: Conditioning
    log_prob_old: torch.Tensor
    advantages: torch.Tensor


class Trainer(Protocol):
    """The members :func:`leancompile.optimize` reads (see the module's docstring for what each means)."""

    config: object  # with the fields of leancompile.trainers.GRPOConfig (the contract sits below the trainers)
    backbone: Backbone
    trainable: list[torch.Tensor]
    sync: object  # a leancompile.trainers.parallel.GradientSync
    sigmas: torch.Tensor
    step_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype

    def step(self, prompts: Sequence) -> dict: ...

    def rollout(self, prompts: Sequence) -> Rollout: ...

    def sde_mask(self) -> torch.Tensor: ...

    def rollout_step(self, step: int, rows: torch.Tensor, x: torch.Tensor, cond: Conditioning,
                     sde: bool) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollout_velocity(self, step: int, rows: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor,
                         cond: Conditioning) -> torch.Tensor: ...

    def trained_step_schedule(self, num_samples: int, sde_steps: torch.Tensor) -> torch.Tensor: ...

    def micro_step(self, rollout: Rollout, advantages: torch.Tensor, rows: torch.Tensor,
                   steps: torch.Tensor) -> MicroStep: ...

    def micro_step_loss(self, micro: MicroStep) -> tuple[torch.Tensor, dict]: ...

    def train_velocity(self, micro: MicroStep) -> torch.Tensor: ...

    def update(self, rollout: Rollout, advantages: torch.Tensor) -> dict: ...

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None: ...

    def optimizer_step(self) -> None: ...


ATTRIBUTES = tuple(Trainer.__annotations__)
METHODS = tuple(name for name, value in vars(Trainer).items() if callable(value) and not name.startswith("_"))


def check_protocol(trainer) -> None:
    """Raise ``TypeError`` naming every member of the protocol that ``trainer`` lacks."""
    missing = [a for a in ATTRIBUTES if not hasattr(trainer, a)]
    missing += [m for m in METHODS if not callable(getattr(trainer, m, None))]
    if missing:
        raise TypeError(f"trainer {type(trainer).__name__} does not implement the leancompile trainer protocol; "
                        f"missing: {missing} (see leancompile.protocol)")
