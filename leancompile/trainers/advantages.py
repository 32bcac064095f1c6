"""Group-normalised advantages of FlowGRPO (population std, eps 1e-4) and DanceGRPO (unbiased std, eps 1e-8)."""
from __future__ import annotations

import torch


def check_rewards(rewards: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Rewards as a float (B,) tensor; a NaN or infinite reward raises naming the sample."""
    rewards = torch.as_tensor(rewards, device=rewards.device if isinstance(rewards, torch.Tensor) else "cpu")
    if rewards.shape != (num_samples,):
        raise ValueError(
            f"reward_fn must return a tensor of shape ({num_samples},), one reward per sample; got {tuple(rewards.shape)}"
        )
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"reward_fn returned non-finite rewards for samples {bad} (values {rewards[bad].tolist()}); "
            "rewards must be finite"
        )
    return rewards.to(torch.float64)


def group_statistics(rewards: torch.Tensor, group_size: int, *, unbiased: bool, global_std: bool = False):
    """``(mean, std)`` per group of ``group_size`` consecutive rewards; ``global_std`` takes the std over all."""
    if rewards.numel() % group_size:
        raise ValueError(f"the number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})")
    groups = rewards.reshape(-1, group_size)
    mean = groups.mean(dim=1)
    std = (rewards.std(correction=int(unbiased)).expand(len(groups)) if global_std
           else groups.std(dim=1, correction=int(unbiased)))
    return mean, std


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    unbiased: bool,
    eps: float,
    global_std: bool = False,
    clip: float | None = None,
) -> torch.Tensor:
    """``(r - mean_group) / (std + eps)`` for consecutive groups of ``group_size`` samples, then clamped to +-clip.

    ``global_std`` takes the std over all rewards instead of per group (the mean stays per group). A group whose
    rewards are all equal gets zero advantages (not NaN): its deviation is exactly zero and ``eps`` keeps the
    denominator positive.
    """
    mean, std = group_statistics(rewards, group_size, unbiased=unbiased, global_std=global_std)
    adv = ((rewards.reshape(-1, group_size) - mean[:, None]) / (std[:, None] + eps)).reshape(-1)
    return adv.clamp(-clip, clip) if clip is not None else adv
