"""Sigma schedules and the stochastic denoising steps of FlowGRPO and DanceGRPO, with log-probabilities.

Every step is a pure function of tensors: ``(x, v, sigma, sigma_next, eta, noise | prev_sample)`` to a
:class:`StepResult`. ``sigma`` and ``sigma_next`` are per-row tensors of shape (B,) so that one batch may hold
rows at different steps (per-sample random trained steps). The rollout passes ``noise`` and gets a fresh sample;
the update passes the stored ``prev_sample`` and gets its log-probability under the current velocity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class StepResult:
    prev_sample: torch.Tensor  # x at the next (less noisy) sigma
    log_prob: torch.Tensor  # (B,) mean over non-batch dims
    mean: torch.Tensor  # the Gaussian's mean, used by the KL penalty
    std: torch.Tensor  # (B,) the Gaussian's std (the KL penalty divides by its square)


def shifted_sigmas(num_steps: int, shift: float, dtype=torch.float64) -> torch.Tensor:
    """``shift * s / (1 + (shift - 1) s)`` over ``linspace(1, 0, num_steps + 1)``: num_steps + 1 values from 1 to 0."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64, device="cpu")
    return (shift * s / (1 + (shift - 1) * s)).to(dtype)


def quantized_timestep(sigma: torch.Tensor) -> torch.Tensor:
    """DanceGRPO feeds the model ``int(sigma * 1000) / 1000``."""
    return torch.floor(sigma * 1000) / 1000


def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B,) tensor viewed so it broadcasts against a (B, ...) tensor."""
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def _gaussian_log_prob(prev_sample, mean, s_rows):
    # The sample is a constant of the density: its gradient flows through the mean only.
    lp = -((prev_sample.detach() - mean) ** 2) / (2 * s_rows**2) - torch.log(s_rows) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.dim())))


def _draw(mean, s_rows, noise, prev_sample):
    if (noise is None) == (prev_sample is None):
        raise ValueError("pass exactly one of noise (to sample) or prev_sample (to score)")
    return mean + s_rows * noise if prev_sample is None else prev_sample


def flow_sde_step(x, v, sigma, sigma_next, eta, noise=None, prev_sample=None) -> StepResult:
    """FlowGRPO's SDE step: Euler-Maruyama of the flow's reverse SDE with noise level ``eta``."""
    sig = _rows(sigma, x)
    sig_next = _rows(sigma_next, x)
    dt = sig_next - sig
    # At sigma == 1 the std would divide by zero; FlowGRPO uses the next sigma there.
    sig_for_std = torch.where(sig == 1, sig_next, sig)
    std = eta * torch.sqrt(sig / (1 - sig_for_std))
    mean = x * (1 + std**2 / (2 * sig) * dt) + v * (1 + std**2 * (1 - sig) / (2 * sig)) * dt
    s = std * torch.sqrt(-dt)
    prev = _draw(mean, s, noise, prev_sample)
    return StepResult(prev, _gaussian_log_prob(prev, mean, s), mean, s.reshape(-1))


def flow_cps_step(x, v, sigma, sigma_next, eta, noise=None, prev_sample=None) -> StepResult:
    """FlowGRPO-Fast's coefficient-preserving step; its log-prob is the unnormalised ``-mean((x' - mean)^2)``."""
    sig = _rows(sigma, x)
    sig_next = _rows(sigma_next, x)
    std = sig_next * math.sin(eta * math.pi / 2)
    x0_hat = x - sig * v
    x1_hat = x + (1 - sig) * v
    mean = x0_hat * (1 - sig_next) + x1_hat * torch.sqrt(sig_next**2 - std**2)
    prev = _draw(mean, std, noise, prev_sample)
    lp = -((prev.detach() - mean) ** 2)
    return StepResult(prev, lp.mean(dim=tuple(range(1, lp.dim()))), mean, std.reshape(-1))


def dance_step(x, v, sigma, sigma_next, eta, noise=None, prev_sample=None) -> StepResult:
    """DanceGRPO's step: Euler mean plus a score correction, std ``eta * sqrt(sigma - sigma_next)``."""
    sig = _rows(sigma, x)
    sig_next = _rows(sigma_next, x)
    dsigma = sig_next - sig
    x0_hat = x - sig * v
    score = -(x - x0_hat * (1 - sig)) / sig**2
    mean = x + dsigma * v - 0.5 * eta**2 * score * dsigma
    std = eta * torch.sqrt(sig - sig_next)
    prev = _draw(mean, std, noise, prev_sample)
    return StepResult(prev, _gaussian_log_prob(prev, mean, std), mean, std.reshape(-1))


def ode_step(x, v, sigma, sigma_next) -> torch.Tensor:
    """The deterministic Euler step used outside the SDE window (FlowGRPO-Fast, MixGRPO)."""
    return x + (_rows(sigma_next, x) - _rows(sigma, x)) * v


STEP_FUNCTIONS = {"sde": flow_sde_step, "cps": flow_cps_step, "dance": dance_step}
