"""TRL's ``GRPOTrainer`` with a wrapped model, and Reweight under loss heads computing in float32 over a float64
module (TRL's log-probabilities are float32 whatever the model's dtype)."""
import os
import warnings

import pytest
import torch

import leancompile
from leancompile.integrations import trl as trl_integration


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
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (wrapped, native)]
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
    torch.testing.assert_close(out, leancompile.unwrap(wrapped)(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- TRL GRPOTrainer

trl = pytest.importorskip("trl")
from benchmarks.trl import grpo_trainer, tiny_causal_lm  # noqa: E402  (after TRL is known to be there)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is built here: nothing is fetched
PROMPTS = ["abc", "bcd", "cde", "def"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 causal LM in float64 saved to a local folder, and its character-level tokenizer."""
    return tiny_causal_lm(32, 2, torch.float64, tmp_path_factory.mktemp("qwen2"))


def _grpo(checkpoint, tmp_path, beta: float, schedule: str | None, wrap_where: str = "model"):
    """Two generations of TRL's GRPO with ``num_iterations=2``: each generation batch (2 prompts x 4 completions)
    is scored by a forward without grad in two chunks, shuffled, then trained over twice in two micro-batches
    per optimizer step (4 optimizer steps). Returns the trained trainer and the wrapped module."""
    trainer, wrapped = grpo_trainer(*checkpoint, PROMPTS * 2, schedule, wrap_where, output_dir=str(tmp_path),
                                    beta=beta)
    trainer.train()
    return trainer, wrapped


def _weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


_NATIVE: dict = {}


def _native(checkpoint, tmp_path_factory, beta: float):
    """Native's trained weights and logged rewards, once per ``beta`` for the module."""
    if beta not in _NATIVE:
        trainer, _ = _grpo(checkpoint, tmp_path_factory.mktemp("native"), beta, None)
        _NATIVE[beta] = _weights(trainer), _rewards(trainer)
    return _NATIVE[beta]


def _rewards(trainer) -> list:
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


# After an optimizer step: the weights changed (what was kept is then freed), or, under Reweight, the rows' gradients
# were used by the first pass
AFTER_A_STEP = {"weights", "nothing kept", "used"}


def _first_iterations_served(wrapped) -> None:
    """The top-level call (TRL's fused head: a loss, float32 log-probabilities, a mask) descended to the decoder;
    per generation: its two scoring calls kept, the first pass's two micro-batches served, the second pass's
    (after an optimizer step) recomputed."""
    records = wrapped.last_calls
    assert [r.action for r in records if r.action == "descended"] == ["descended"]
    actions = [(r.action, r.kind) for r in records if r.action in ("kept", "served", "recomputed")]
    assert len(actions) == 12, actions
    for generation in (actions[:6], actions[6:]):
        assert generation[:4] == [("kept", "")] * 2 + [("served", "")] * 2, actions
        assert all(action == "recomputed" and kind in AFTER_A_STEP for action, kind in generation[4:]), actions
    stats = wrapped.stats()
    assert stats["served_by"] == "model" and stats["served_calls"] == 4 and stats["recomputed_calls"] == 4, stats
    assert set(stats["recompute_reasons"]) <= AFTER_A_STEP, stats


# The decoder's output reaches TRL's log-probabilities through float32 (its fused head casts the logits), which
# bounds what Reweight's combination of per-row gradients can match; Retain's served backward is the decoder's own.
RETAIN_TOLERANCE = 1e-10
REWEIGHT_TOLERANCE = 1e-6

# Where the tests wrap the model: the user's one line before the trainer is built.
WRAP_WHERE = "model"


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("schedule", ["retain", "auto"])
def test_grpo_trainer_wrapped_trains_as_native_and_serves_each_generations_first_iteration(
        checkpoint, tmp_path_factory, schedule, beta):
    native_weights, native_rewards = _native(checkpoint, tmp_path_factory, beta)
    trainer, wrapped = _grpo(checkpoint, tmp_path_factory.mktemp(schedule), beta, schedule, WRAP_WHERE)
    assert _rewards(trainer) == native_rewards
    assert _relative(_weights(trainer), native_weights) <= RETAIN_TOLERANCE
    _first_iterations_served(wrapped)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_trainer_under_reweight_trains_as_native_to_float32(checkpoint, tmp_path_factory, beta):
    """TRL's loss, handed over by ``integrations.trl.reweight`` right after each rollout, gives each kept row its
    gradients; the first iteration is served from them (the KL term: a second head at advantage 0)."""
    native_weights, native_rewards = _native(checkpoint, tmp_path_factory, beta)
    trainer, wrapped = _grpo(checkpoint, tmp_path_factory.mktemp("reweight"), beta, "reweight", WRAP_WHERE)
    assert _rewards(trainer) == pytest.approx(native_rewards, rel=1e-6)
    assert _relative(_weights(trainer), native_weights) <= REWEIGHT_TOLERANCE
    _first_iterations_served(wrapped)


def test_reweight_integration_refuses_what_it_cannot_serve_by_name(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="trainer must be a trl.GRPOTrainer"):
        trl_integration.reweight(torch.nn.Linear(2, 2))
    native, _ = grpo_trainer(*checkpoint, PROMPTS, None, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="trainer.model is not wrapped"):
        trl_integration.reweight(native)
    with pytest.raises(ValueError, match="wrap it with schedule='reweight'"):
        trl_integration.reweight(grpo_trainer(*checkpoint, PROMPTS, "retain", WRAP_WHERE, output_dir=str(tmp_path))[0])
    # One pass per generation: TRL reuses the update's own log-probabilities, nothing runs twice
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 is a multiple of steps_per_generation"):
        grpo_trainer(*checkpoint, PROMPTS, "reweight", WRAP_WHERE, output_dir=str(tmp_path), steps_per_generation=1)


def test_the_benchmark_row_of_trl(monkeypatch):
    """Native and wrapped trainers take their generations in alternation in one process (each in a thread of its
    own that pauses between generations); the FLOP counter of the caller counts the trainer's work."""
    from benchmarks import loops
    from benchmarks.trl import TrlConfig, TrlLoop

    config = TrlConfig(prompts=2, group=2, micro_batch=2, max_new_tokens=3, hidden=32, layers=2,
                       dtype=torch.float64, wrap_where=WRAP_WHERE)
    monkeypatch.setitem(loops.LOOPS, "llm/trl", (TrlLoop, config))
    row = loops.measure_loop("llm/trl", repetitions=1)
    # Each generation: the first pass's two micro-batches served, the second's two recomputed
    assert (row["served_calls"], row["recomputed_calls"]) == (2, 2), row
    assert 1.0 < row["ideal_speedup"] < 2.0 and row["native_flops"] > row["optimized_flops"] > 0
    assert row["max_rel_weight_diff"] <= 1e-10
    assert "| llm/trl (full), wrap (retain) |" in loops.loops_markdown([row])


def test_a_served_trl_run_warns_nothing(checkpoint, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", leancompile.NothingServedWarning)
        _grpo(checkpoint, tmp_path, 0.0, "retain", WRAP_WHERE)
    assert not [w for w in caught if issubclass(w.category, leancompile.NothingServedWarning)], \
        [str(w.message) for w in caught if issubclass(w.category, leancompile.NothingServedWarning)]
