import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leancompile.trainers.advantages import check_rewards, group_advantages


@given(
    groups=st.integers(1, 4),
    group_size=st.integers(2, 6),
    unbiased=st.booleans(),
    global_std=st.booleans(),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_group_advantages_match_numpy(groups, group_size, unbiased, global_std, seed):
    rewards = np.random.default_rng(seed).normal(size=groups * group_size)
    eps = 1e-8 if unbiased else 1e-4
    adv = group_advantages(torch.tensor(rewards), group_size, unbiased=unbiased, eps=eps, global_std=global_std)
    r = rewards.reshape(groups, group_size)
    std = rewards.std(ddof=int(unbiased)) if global_std else r.std(axis=1, ddof=int(unbiased), keepdims=True)
    expected = ((r - r.mean(axis=1, keepdims=True)) / (std + eps)).reshape(-1)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_clip_binds_and_zero_variance_groups_give_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, unbiased=False, eps=1e-4, clip=1.5)
    assert torch.equal(adv[:4], torch.zeros(4, dtype=torch.float64))
    assert float(adv[7]) == 1.5 and bool(torch.isfinite(adv).all())


def test_non_finite_rewards_name_the_sample():
    with pytest.raises(ValueError, match=r"samples \[1, 3\]"):
        check_rewards(torch.tensor([0.0, float("nan"), 1.0, float("inf")]), 4)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        check_rewards(torch.zeros(3), 4)
