"""Each step formula against an independent closed form."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leancompile.trainers.sampling import (
    dance_step,
    flow_cps_step,
    flow_sde_step,
    ode_step,
    quantized_timestep,
    shifted_sigmas,
)

STEPS = {"sde": flow_sde_step, "cps": flow_cps_step, "dance": dance_step}


def _case(seed, batch=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, 4, 4, generator=g, dtype=torch.float64)
    v = torch.randn(batch, 2, 4, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(batch, 2, 4, 4, generator=g, dtype=torch.float64)
    return x, v, noise


def _score(x, v, sigma):
    """The flow's score: -(x - (1 - sigma) x0_hat) / sigma^2 with x0_hat = x - sigma v."""
    s = sigma.reshape(-1, 1, 1, 1)
    return -(x - (1 - s) * (x - s * v)) / s**2


@given(seed=st.integers(0, 1000), i=st.integers(0, 8), eta=st.floats(0.1, 1.0))
@settings(max_examples=30, deadline=None)
def test_sde_step_is_reverse_sde_euler_maruyama_with_normal_log_prob(seed, i, eta):
    x, v, noise = _case(seed)
    sig = shifted_sigmas(10, 3.0)
    sigma, sigma_next = sig[i].expand(3), sig[i + 1].expand(3)
    res = flow_sde_step(x, v, sigma, sigma_next, eta, noise=noise)
    dt = float(sig[i + 1] - sig[i])
    sigma_for_std = float(sig[i + 1]) if float(sig[i]) == 1.0 else float(sig[i])
    std = eta * math.sqrt(float(sig[i]) / (1 - sigma_for_std))
    # Drift of the reverse SDE: v - (std^2 / 2) * score.
    mean = x + dt * (v - 0.5 * std**2 * _score(x, v, sigma))
    s = std * math.sqrt(-dt)
    torch.testing.assert_close(res.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.prev_sample, mean + s * noise, rtol=1e-12, atol=1e-12)
    expected = torch.distributions.Normal(mean, s).log_prob(res.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(res.log_prob, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.std, torch.full((3,), s, dtype=torch.float64))


@given(seed=st.integers(0, 1000), i=st.integers(0, 14), eta=st.floats(0.1, 1.0))
@settings(max_examples=30, deadline=None)
def test_dance_step_matches_closed_form_and_normal_log_prob(seed, i, eta):
    x, v, noise = _case(seed)
    sig = shifted_sigmas(16, 3.0)
    res = dance_step(x, v, sig[i].expand(3), sig[i + 1].expand(3), eta, noise=noise)
    dsigma = float(sig[i + 1] - sig[i])
    mean = x + dsigma * v - 0.5 * eta**2 * _score(x, v, sig[i].expand(3)) * dsigma
    std = eta * math.sqrt(-dsigma)
    torch.testing.assert_close(res.mean, mean, rtol=1e-12, atol=1e-12)
    expected = torch.distributions.Normal(mean, std).log_prob(mean + std * noise).mean(dim=(1, 2, 3))
    torch.testing.assert_close(res.log_prob, expected, rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 1000), i=st.integers(0, 8), eta=st.floats(0.05, 0.95))
@settings(max_examples=30, deadline=None)
def test_cps_step_preserves_coefficients(seed, i, eta):
    x, v, noise = _case(seed)
    sig = shifted_sigmas(10, 3.0)
    res = flow_cps_step(x, v, sig[i].expand(3), sig[i + 1].expand(3), eta, noise=noise)
    # x_next = (1 - s') x0_hat + sqrt(s'^2 - std^2) x1_hat + std * eps: the noise coefficients' squares sum to s'^2.
    s_next = float(sig[i + 1])
    std = s_next * math.sin(eta * math.pi / 2)
    x0_hat, x1_hat = x - float(sig[i]) * v, x + (1 - float(sig[i])) * v
    expected = (1 - s_next) * x0_hat + math.sqrt(max(s_next**2 - std**2, 0.0)) * x1_hat + std * noise
    torch.testing.assert_close(res.prev_sample, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.log_prob, -((std * noise) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_every_step_tends_to_the_euler_ode_step_without_noise(kind):
    x, v, noise = _case(0)
    sig = shifted_sigmas(10, 3.0)
    sigma, sigma_next = sig[3].expand(3), sig[4].expand(3)
    res = STEPS[kind](x, v, sigma, sigma_next, 1e-7, noise=noise)
    torch.testing.assert_close(res.prev_sample, ode_step(x, v, sigma, sigma_next), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_scoring_the_sampled_point_reproduces_the_sampling_log_prob(kind):
    x, v, noise = _case(1)
    sig = shifted_sigmas(10, 3.0)
    sigma, sigma_next = sig[2:5], sig[3:6]  # rows at different steps
    drawn = STEPS[kind](x, v, sigma, sigma_next, 0.7, noise=noise)
    scored = STEPS[kind](x, v, sigma, sigma_next, 0.7, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(scored.log_prob, drawn.log_prob, rtol=0, atol=0)


def test_step_needs_exactly_one_of_noise_and_prev_sample():
    x, v, noise = _case(2)
    s = torch.full((3,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="exactly one of noise"):
        flow_sde_step(x, v, s, s * 0.5, 0.7)
    with pytest.raises(ValueError, match="exactly one of noise"):
        dance_step(x, v, s, s * 0.5, 0.7, noise=noise, prev_sample=x)


def test_shifted_sigmas_and_quantised_timesteps():
    sig = shifted_sigmas(16, 3.0)
    assert sig.shape == (17,) and float(sig[0]) == 1.0 and float(sig[-1]) == 0.0
    assert bool((sig[1:] < sig[:-1]).all())
    s = 0.5
    assert float(shifted_sigmas(2, 3.0)[1]) == pytest.approx(3 * s / (1 + 2 * s))
    torch.testing.assert_close(quantized_timestep(torch.tensor([0.12345, 0.9999], dtype=torch.float64)),
                               torch.tensor([0.123, 0.999], dtype=torch.float64))
