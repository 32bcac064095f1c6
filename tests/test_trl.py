"""TRL's ``GRPOTrainer`` with a wrapped model, and Reweight under loss heads computing in float32 over a float64
module (TRL's log-probabilities are float32 whatever the model's dtype)."""
import copy

import pytest
import torch

import leancompile
from leancompile.runtime.reweight import ProvisionalRows


# ------------------------------------------------------------------------ Reweight under a float32 head

ROWS, CLASSES = 8, 5


def _policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)).double()


def _log_prob_loss(output: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A policy-gradient loss whose log-probabilities are computed in float32 from a float64 output, as TRL's."""
    logp = torch.log_softmax(output.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    return -(advantages * logp).sum() / len(targets)


def _float32_head_run(head):
    """A rollout call without grad, the provisional ``head`` (given the wrapped module, the inputs and targets),
    then the update's call with grad on shuffled rows; returns the wrapped module, its gradient and native's."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 6, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    advantages = torch.randn(ROWS, generator=generator)  # float32, as TRL's
    order = torch.randperm(ROWS, generator=generator)
    native = _policy()
    _log_prob_loss(native(x[order]), targets[order], advantages[order]).backward()
    wrapped = leancompile.wrap(_policy(), schedule="reweight")
    with torch.no_grad():
        wrapped(x)
    wrapped.provisional(lambda a: head(wrapped, x, targets, a))
    _log_prob_loss(wrapped(x[order]), targets[order], advantages[order]).backward()
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (wrapped.module, native)]
    return wrapped, *grads


def _relative(a, b) -> float:
    assert b.norm() > 0, "a zero gradient tells nothing"
    return float((a - b).norm() / b.norm())


def test_reweight_serves_a_float64_module_under_a_float32_head_exact_to_float32():
    """The heads' cotangents are float64 tensors holding float32's rounding: the span test allows that rounding
    (a float64 tolerance, 2e-13, recomputed every such call), and the served gradient is native's to float32's
    precision."""
    head = lambda wrapped, x, targets, a: _log_prob_loss(wrapped(x), targets, torch.full((ROWS,), a))
    wrapped, grad, native = _float32_head_run(head)
    assert [kept.rows.precision for kept in wrapped.engine.kept] == [torch.float32]
    stats = wrapped.stats()
    assert stats["served_calls"] == 1 and stats["recomputed_calls"] == 0, stats
    assert _relative(grad, native) <= 1e-6


def test_a_float64_head_keeps_the_float64_tolerance():
    head = lambda wrapped, x, targets, a: -(a * torch.log_softmax(wrapped(x), -1).gather(-1, targets[:, None])).mean()
    wrapped, _, _ = _float32_head_run(head)
    assert [kept.rows.precision for kept in wrapped.engine.kept] == [torch.float64]


def test_a_wrong_float32_head_still_recomputes():
    """A head whose cotangents point elsewhere (the output's squares) leaves residuals far above float32's rounding:
    the update's call recomputes natively, exact."""
    head = lambda wrapped, x, targets, a: a * (wrapped(x).float() ** 2).sum()
    wrapped, grad, native = _float32_head_run(head)
    stats = wrapped.stats()
    assert stats["served_calls"] == 0 and stats["recompute_reasons"] == {"cotangent": 1}, stats
    assert _relative(grad, native) <= 1e-12


def test_an_optimizer_step_by_a_fused_optimizer_ends_what_was_kept():
    """``torch.optim.AdamW(fused=True)`` (transformers' ``Trainer`` default) writes the weights in place without
    moving their version counters; the next call with grad must not be served the values of the weights before."""
    wrapped = leancompile.wrap(_policy())
    x = torch.randn(ROWS, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        wrapped(x)
    wrapped(x).sum().backward()
    optimizer.step()
    out = wrapped(x)
    assert [r.action for r in wrapped.last_calls] == ["kept", "served", "recomputed"]
    assert wrapped.last_calls[-1].kind == "weights"
    torch.testing.assert_close(out, wrapped.module(x), rtol=0, atol=0)
