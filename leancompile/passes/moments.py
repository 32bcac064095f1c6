"""Moments: when may Reweight keep a constant number of gradient buffers per group instead of one per sample?

With group statistics the advantage is affine in the reward, ``A_i = (r_i - m_g) / (s_g + eps)``, so
``sum_i A_i g_i = (sum_i r_i g_i - m_g sum_i g_i) / (s_g + eps)``: a finished sample's gradient buffer ``g_i``
folds into two per-group sums, and the group's mean and std are applied at the end. That is exact only if the
clip ``adv_clip_max`` never binds, which holds for every reward draw when the largest possible ``|A|`` is below it.

The largest ``|A|``: with deviations ``d_j = r_j - m_g`` (summing to 0), ``|d_1|`` is largest relative to the
spread when the other ``G - 1`` deviations are equal (for a fixed ``d_1`` their sum is fixed at ``-d_1``, and equal
terms minimise their sum of squares), so the bound is ``|d_1| / std(d)`` at ``d = (1, -1/(G-1), ...)``, derived
below with sympy for each normalisation. With a global std the other groups can only add spread, so the worst
case holds them at the group's mean. ``eps > 0`` makes the true ``|A|`` strictly smaller than the bound.

Population std: ``sqrt(G - 1)`` (a clip at 5 never binds for ``G <= 26``); unbiased std: ``(G - 1) / sqrt(G)``;
global std over ``N`` rewards: ``sqrt(N (G - 1) / G)``, unbiased ``sqrt((N - 1)(G - 1) / G)``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import sympy

G, N = sympy.symbols("G N", positive=True, integer=True)


@functools.cache
def advantage_bound(unbiased: bool, global_std: bool) -> sympy.Expr:
    """The largest ``|A|`` as an expression in the group size ``G`` (and the number of rewards ``N``)."""
    spread = 1 + (G - 1) * (1 / (G - 1)) ** 2  # sum of squared deviations at the extremal configuration
    count = N if global_std else G
    variance = spread / (count - 1 if unbiased else count)
    return sympy.simplify(1 / sympy.sqrt(variance))


def max_abs_advantage(group_size: int, unbiased: bool, global_std: bool = False, num_samples: int | None = None
                      ) -> float:
    """The bound evaluated for one configuration (``num_samples`` is needed with a global std)."""
    if global_std and num_samples is None:
        raise ValueError("num_samples is required with global_std=True: the global std spans all rewards")
    values = {G: group_size, N: num_samples if num_samples is not None else group_size}
    return float(advantage_bound(unbiased, global_std).subs(values))


def clip_never_binds(config, num_samples: int) -> tuple[bool, str]:
    """Whether ``config.adv_clip_max`` is provably inactive for ``num_samples`` rewards, and the bound that says so."""
    bound = max_abs_advantage(config.group_size, config.adv_unbiased, config.global_std, num_samples)
    expr = advantage_bound(config.adv_unbiased, config.global_std)
    inactive = bound <= config.adv_clip_max
    verdict = "never binds" if inactive else "may bind"
    return inactive, (f"|A| < {expr} = {bound:.3g} at G={config.group_size}" +
                      (f", N={num_samples}" if config.global_std else "") +
                      f": the clip at {config.adv_clip_max:g} {verdict}")


class BufferPlan(NamedTuple):
    """How Reweight holds one GRPO step's provisional gradients."""

    accumulate: bool  # moment accumulators (True) or one buffer per sample
    reason: str
    count: int  # buffers held at the peak


def reweight_buffers(config, has_free: bool, num_samples: int) -> BufferPlan:
    """Whether this step's Reweight may fold finished samples into per-group moments, and how many buffers it
    then holds (a sample with advantage-free loss terms needs a second buffer)."""
    per = 1 + has_free
    window = min(num_samples, config.gradient_accumulation_steps * config.train_batch_size)
    if getattr(config, "parallel", "none") != "none" and (config.same_prompt_groups or config.global_std):
        return BufferPlan(False, "per-sample buffers: the advantages normalise rewards gathered from every rank",
                          window * per)
    inactive, bound = clip_never_binds(config, num_samples)
    if not inactive:
        return BufferPlan(False, f"per-sample buffers: {bound}", window * per)
    tbs, ga = config.train_batch_size, config.gradient_accumulation_steps
    if num_samples > ga * tbs:
        return BufferPlan(False, f"per-sample buffers: {num_samples} samples span more than the first optimizer "
                                 f"step ({ga} x {tbs})", window * per)
    if num_samples > tbs and num_samples % tbs:
        return BufferPlan(False, f"per-sample buffers: {num_samples} samples make micro-batches of unequal size "
                                 f"({tbs})", window * per)
    in_flight = min(config.sample_batch_size or num_samples, num_samples) * per
    folded = in_flight + (num_samples // config.group_size) * (2 + has_free)
    if folded >= num_samples * per:
        return BufferPlan(False, f"per-sample buffers: {num_samples * per} buffers; moments would hold {folded} "
                                 "(the rollout runs too many samples at once)", window * per)
    return BufferPlan(True, f"moment accumulators ({bound}): {folded} buffers instead of {num_samples * per}",
                      folded)
