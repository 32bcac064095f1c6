"""``leancompile.wrap`` on training loops leancompile did not write: the examples (a FlowGRPO-style SD3 loop, a
DanceGRPO-style Flux loop, an LLM GRPO loop) train exactly as their native versions, and serve every update call
their optimizer steps allow; what cannot be verified runs natively."""
import dataclasses
import functools
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leancompile
from examples import dancegrpo_flux, flowgrpo_sd3, grpo_llm
from examples.loop_cli import trained_module
from leancompile.runtime.regional import RegionalEngine, transformer_blocks



class DenseRewardLLM(grpo_llm.Loop):
    """The LLM loop with a reward graded by distance: a few samples of an untrained model always differ in it (an
    exact-match reward is zero for all of them most of the time, and so is the gradient)."""

    def rewards(self, sequences, answers, prompt_length):
        answer = answers.repeat_interleave(self.config.group, 0)
        return -(sequences[:, prompt_length] - answer).abs().to(torch.float32)


# Small versions of each loop, and the update calls each serves in two GRPO steps: FlowGRPO-style, those before the
# first of its two optimizer steps per rollout; DanceGRPO-style and the LLM loop, all of them.
LOOPS = {
    "flowgrpo_sd3": (flowgrpo_sd3.Loop, flowgrpo_sd3.Config(num_steps=4, train_steps=3, dtype=torch.float64), 2 * 3),
    "dancegrpo_flux": (dancegrpo_flux.Loop, dancegrpo_flux.Config(num_steps=6, dtype=torch.float64), 2 * 4 * 3),
    "grpo_llm": (DenseRewardLLM, grpo_llm.Config(prompts=4, group=4, micro_batch=8, dtype=torch.float64), 2 * 2),
}


def _run(loop_class, config, use_leancompile: bool, steps: int = 2):
    """``steps`` GRPO steps of the loop with plain SGD (Adam's first steps are sign-like and would hide a
    gradient's difference); returns the loop, its rewards and the gradient each optimizer step applied."""
    loop = loop_class(config, use_leancompile=use_leancompile)
    params = [p for p in trained_module(loop).parameters() if p.requires_grad]
    loop.optimizer = torch.optim.SGD(params, lr=0.05)
    applied = []
    loop.optimizer.register_step_pre_hook(lambda *_: applied.append(torch.cat([p.grad.flatten() for p in params])))
    rewards = [loop.step() for _ in range(steps)]
    return loop, rewards, applied


@functools.lru_cache(maxsize=None)
def _native(loop_class, config, steps: int = 2):
    """The native loop's rewards and applied gradients, run once per process for each wrapped run compared to them
    (the native loop reads no schedule)."""
    _, rewards, grads = _run(loop_class, dataclasses.replace(config, schedule="retain"), False, steps)
    return rewards, grads


def _relative(a, b) -> float:
    assert b.norm() > 0, "a zero gradient tells nothing"
    return float((a - b).norm() / b.norm())


@pytest.mark.fast
@pytest.mark.parametrize("name", LOOPS)
def test_a_wrapped_loop_trains_exactly_as_its_native_version(name):
    loop_class, config, served = LOOPS[name]
    native, native_rewards, native_grads = _run(loop_class, config, False)
    wrapped, rewards, grads = _run(loop_class, config, True)
    assert rewards == pytest.approx(native_rewards, rel=1e-10)
    assert len(grads) == len(native_grads)
    for g, g_native in zip(grads, native_grads):
        assert _relative(g, g_native) <= 1e-10
    weights = torch.cat([p.detach().flatten() for p in trained_module(wrapped).parameters()])
    native_weights = torch.cat([p.detach().flatten() for p in trained_module(native).parameters()])
    assert _relative(weights, native_weights) <= 1e-10
    stats = trained_module(wrapped).stats()
    assert stats["served_calls"] == served, stats


@pytest.mark.parametrize("name", LOOPS)
def test_under_auto_a_loop_trains_exactly_and_serves_what_retain_serves(name):
    loop_class, config, served = LOOPS[name]
    _, native_grads = _native(loop_class, config)
    wrapped, _, grads = _run(loop_class, dataclasses.replace(config, schedule="auto"), True)
    for g, g_native in zip(grads, native_grads, strict=True):
        assert _relative(g, g_native) <= 1e-10
    assert trained_module(wrapped).stats()["served_calls"] == served


def test_auto_past_the_memory_limit_runs_the_rest_natively_on_the_cpu(monkeypatch):
    """The first call kept passes a one-byte limit; the host's memory is the CPU's, so nothing is offloaded and the
    update's other calls recompute, exact."""
    monkeypatch.setattr(leancompile, "wrap", functools.partial(leancompile.wrap, memory_limit=1))
    loop_class, config, _ = LOOPS["dancegrpo_flux"]
    _, native_grads = _native(loop_class, config, 1)
    wrapped, _, grads = _run(loop_class, dataclasses.replace(config, schedule="auto"), True, steps=1)
    assert _relative(grads[0], native_grads[0]) <= 1e-10
    module = trained_module(wrapped)
    kept = [r for r in module.last_calls if r.action == "kept"]
    assert [r.reason for r in kept] == ["retain"]
    stats = module.stats()
    assert stats["recomputed_calls"] > stats["served_calls"] and stats["recompute_reasons"].keys() <= {"inputs"}


def test_the_trained_hint_keeps_only_the_calls_the_update_trains():
    """FlowGRPO-style: the update trains the first ``train_steps`` steps of each sampling batch, and says so; the
    rollout's other calls run natively and keep nothing."""
    loop_class, config, served = LOOPS["flowgrpo_sd3"]
    wrapped, _, _ = _run(loop_class, config, True, steps=1)
    kept = [r for r in trained_module(wrapped).last_calls if r.action == "kept"]
    batches = config.prompts * config.group // config.sample_batch
    assert len(kept) == batches * config.train_steps < batches * config.num_steps
    assert trained_module(wrapped).stats()["served_calls"] == served // 2  # one of the two GRPO steps


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_wrapped_per_block_trains_exactly_as_its_native_version(name, monkeypatch):
    """Each block's calls kept and served by an engine of its own, the module around them run natively (what wrap
    does under FSDP2). FlowGRPO-style's rollout runs in ``eval()`` and its update in ``train()``: the calls'
    training flags differ, and the module's forward traced in both modes is one graph (no dropout with p > 0, no
    batch norm), as is each block's one-row program, so its blocks are served too."""
    monkeypatch.setattr(leancompile, "wrap", functools.partial(leancompile.wrap, per_block=True))
    loop_class, config, served = LOOPS[name]
    _, native_grads = _native(loop_class, config)
    wrapped, _, grads = _run(loop_class, config, True)
    for g, g_native in zip(grads, native_grads, strict=True):
        assert _relative(g, g_native) <= 1e-10
    module = trained_module(wrapped)
    stats = module.stats()
    assert isinstance(module.engine, RegionalEngine)
    # block calls: every update call's blocks
    assert stats["served_calls"] == served * len(transformer_blocks(module)), stats


@settings(max_examples=6, deadline=None)
@given(prompts=st.integers(1, 4), group=st.sampled_from([2, 4]), micro=st.sampled_from([1, 2, 8]),
       clip=st.sampled_from([0.2, 1e-4]), seed=st.integers(0, 3))
def test_llm_loop_at_any_rollout_and_micro_batch(prompts, group, micro, clip, seed):
    """The update's micro-batches hold any rows of the rollout's one call: each is served from those rows."""
    config = grpo_llm.Config(prompts=prompts, group=group, micro_batch=micro, clip=clip, seed=seed,
                             dtype=torch.float64)
    _, native_grads = _native(DenseRewardLLM, config, 1)
    wrapped, _, grads = _run(DenseRewardLLM, config, True, steps=1)
    assert _relative(grads[0], native_grads[0]) <= 1e-10
    assert wrapped.model.stats()["served_calls"] == -(-prompts * group // micro)  # one per micro-batch


def test_under_bf16_autocast_the_served_gradient_points_where_natives_does():
    """The loop's forwards under bf16 autocast: the kept call is compiled under it too; the gradient rounds
    differently from eager's, in the last bits."""
    config = grpo_llm.Config(prompts=4, group=4, micro_batch=8, autocast=torch.bfloat16)
    _, native_grads = _native(DenseRewardLLM, config, 1)
    wrapped, _, grads = _run(DenseRewardLLM, config, True, steps=1)
    cosine = torch.nn.functional.cosine_similarity(grads[0], native_grads[0], dim=0)
    assert cosine >= 0.999, float(cosine)
    assert wrapped.model.stats()["served_calls"] == 2


def test_with_dropout_the_update_in_train_mode_recomputes_what_the_rollout_ran_in_eval_mode():
    """The FlowGRPO-style loop samples in ``eval()`` and trains in ``train()``: without dropout both compile to the
    same graphs and calls are served (the test above); with dropout the update's calls draw random numbers, so
    they run natively, and the loop still gets native's gradients."""
    config = flowgrpo_sd3.Config(num_steps=3, train_steps=2, dtype=torch.float64)

    class WithDropout(flowgrpo_sd3.Loop):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for module in trained_module(self).modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.1

        def step(self):
            torch.manual_seed(1)  # dropout's draws: the same in both runs
            return super().step()

    _, native_grads = _native(WithDropout, config, 1)
    wrapped, _, grads = _run(WithDropout, config, True, steps=1)
    assert _relative(grads[0], native_grads[0]) <= 1e-10
    stats = trained_module(wrapped).stats()
    assert stats["served_calls"] == 0 and stats["recompute_reasons"].get("training flags", 0) > 0, stats


def test_the_wrapper_draws_nothing_from_torchs_generator():
    """Compiling a kept call (and timing its matrix products) leaves the loop's random stream alone."""
    loop = grpo_llm.Loop(grpo_llm.Config(prompts=2, group=2, micro_batch=4))
    state = torch.get_rng_state()
    sequences = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loop.model(input_ids=sequences, use_cache=False)
    assert loop.model.last_calls[-1].action == "kept"
    assert torch.equal(torch.get_rng_state(), state)


def test_calls_are_kept_up_to_the_memory_limit_then_run_natively():
    loop = grpo_llm.Loop(grpo_llm.Config())
    model = leancompile.wrap(leancompile.unwrap(trained_module(loop)), memory_limit=1)
    sequences = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=sequences + _, use_cache=False)
    assert [r.action for r in model.last_calls] == ["kept"]  # the first passes the limit by its own size
    assert model.stats()["retained_bytes"] > 0


def test_a_call_the_engine_cannot_keep_runs_natively_and_says_why():
    loop = grpo_llm.Loop(grpo_llm.Config())
    sequences = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = loop.model(input_ids=sequences)  # a cache in the output: not one tensor
    assert out.past_key_values is not None
    record = loop.model.last_calls[-1]
    assert record.action == "not kept" and "a kept call returns tensors and constants" in record.reason


@pytest.mark.parametrize("kwargs, message", [
    (dict(module=torch.nn.Linear(2, 2), schedule="recompute"), "schedule must be one of"),
    (dict(module="model"), "module must be a torch.nn.Module"),
    (dict(module=torch.nn.Linear(2, 2), memory_limit=-1), "memory_limit must be a positive"),
    (dict(module=torch.nn.Linear(2, 2), shared="img_ids"), "shared must be a tuple"),
    (dict(module=torch.nn.Linear(2, 2), per_block="yes"), "per_block must be True, False or None"),
    (dict(module=torch.nn.Linear(2, 2), trained=3), "trained must be a callable"),
    (dict(module=torch.nn.Linear(2, 2), per_block=True), "Linear has no stack of identical blocks"),
    (dict(module=torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])), per_block=True,
          bitwise=True), "it cannot serve bitwise=True"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        leancompile.wrap(**kwargs)


class WrongHeadLLM(DenseRewardLLM):
    """Hands Reweight a head whose cotangents point elsewhere than the update's (the logits' squares, at the
    advantage): no served call's cotangent lies in their span."""

    def rollout(self, questions):
        self.last = super().rollout(questions)
        return self.last

    def step(self):
        provisional = self.model.provisional

        def wrong(head):
            sequences, mask, _ = self.last
            logits = lambda: self.model(input_ids=sequences, attention_mask=mask, use_cache=False).logits
            provisional(lambda a: a * (logits() ** 2).sum())

        self.model.provisional = wrong
        try:
            return super().step()
        finally:
            del self.model.provisional


# Llama's RMSNorm computes its variance in float32 whatever the model's dtype, and Reweight backpropagates the
# cotangent of advantage 1 and scales afterwards where native backpropagates the scaled one: they round
# differently there, so float64 agreement is bounded by float32 rounding (7e-8 measured), as for Flux and Wan.
REWEIGHT_FLOAT32_ISLAND = 1e-5


@settings(max_examples=4, deadline=None)
@given(prompts=st.integers(1, 4), group=st.sampled_from([2, 4]), micro=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 3))
def test_reweight_on_a_wrapped_llm_loop_gives_natives_gradient(prompts, group, micro, seed):
    """Under ``schedule="reweight"`` the loop hands the update's loss to ``provisional`` once the rollout is done;
    every micro-batch of the update is then served from the per-row gradients."""
    config = grpo_llm.Config(prompts=prompts, group=group, micro_batch=micro, seed=seed, dtype=torch.float64,
                             schedule="reweight")
    native_rewards, native_grads = _native(DenseRewardLLM, config)
    wrapped, rewards, grads = _run(DenseRewardLLM, config, True)
    assert rewards == native_rewards
    for g, g_native in zip(grads, native_grads, strict=True):  # all rewards of every group equal: no gradient
        assert _relative(g, g_native) <= REWEIGHT_FLOAT32_ISLAND if g_native.norm() > 0 else g.norm() == 0
    stats = wrapped.model.stats()
    assert stats["served_calls"] == 2 * -(-prompts * group // micro) and stats["recomputed_calls"] == 0, stats


# Under Reweight each loop hands its update's loss to ``provisional`` once it knows which steps it trains. SD3 is
# built without its qk-norm, whose variance computes in float32 whatever the model's dtype (an island like
# Llama's RMSNorm above): float64 rounding then bounds it.
REWEIGHT_LOOPS = {"flowgrpo_sd3": (dict(sizes=(("qk_norm", None),)), 1e-10),
                  "dancegrpo_flux": ({}, REWEIGHT_FLOAT32_ISLAND), "grpo_llm": ({}, REWEIGHT_FLOAT32_ISLAND)}


@pytest.mark.parametrize("name", LOOPS)
def test_a_wrapped_loop_under_reweight_trains_as_its_native_version(name):
    """The same calls with grad are served as under Retain (FlowGRPO-style: those before the first optimizer step,
    the only ones its head covers); the kept calls no head reaches (a step DanceGRPO does not train) are freed
    unused. A KL reference's calls in the heads are not kept as rollout calls: their values are, and the second
    head and the update are served them."""
    loop_class, config, served = LOOPS[name]
    changes, tolerance = REWEIGHT_LOOPS[name]
    config = dataclasses.replace(config, schedule="reweight", **changes)
    native_rewards, native_grads = _native(loop_class, config)
    wrapped, rewards, grads = _run(loop_class, config, True)
    assert rewards == pytest.approx(native_rewards, rel=1e-6)
    for g, g_native in zip(grads, native_grads, strict=True):
        assert _relative(g, g_native) <= tolerance
    records = trained_module(wrapped).last_calls
    assert sum(r.action == "served" for r in records) == served
    if getattr(config, "beta", 0):  # the heads' KL reference calls: values kept, never admitted as rollout calls
        assert not any(r.action == "not kept" for r in records)
        # Each served micro-step's reference call is served the values, and so is the second head's.
        assert sum(r.action == "served values" for r in records) == 2 * served


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_wrapped_per_block_under_reweight_trains_as_its_native_version(name, monkeypatch):
    """Each block keeps its per-row gradients, their coefficients found at the module's output (see
    runtime.reweight). The Flux loop serves every update call's blocks. The LLM loop's group samples equal
    completions, and a row equal to several kept rows recomputes (which equal row a block serves is its own
    engine's choice); FlowGRPO-style, sampled in ``eval()`` and trained in ``train()``, serves its update calls'
    blocks as under Retain."""
    monkeypatch.setattr(leancompile, "wrap", functools.partial(leancompile.wrap, per_block=True))
    loop_class, config, served = LOOPS[name]
    changes, tolerance = REWEIGHT_LOOPS[name]
    config = dataclasses.replace(config, schedule="reweight", **changes)
    _, native_grads = _native(loop_class, config)
    wrapped, _, grads = _run(loop_class, config, True)
    for g, g_native in zip(grads, native_grads, strict=True):
        assert _relative(g, g_native) <= tolerance
    module = trained_module(wrapped)
    reasons = {r.reason for r in module.last_calls if r.action == "recomputed"}
    served_values = sum(r.action == "served values" for r in module.last_calls)
    stats = module.stats()
    if name == "flowgrpo_sd3":  # the KL reference's calls (adapters off): run once in the heads, then served
        assert stats["served_values"] == served_values > 0
        assert stats["served_calls"] == served * len(transformer_blocks(module)), stats
    elif name == "grpo_llm":
        assert stats["served_calls"] > 0
        assert reasons <= {"Reweight per block: a row equals several kept rows"}, reasons
    else:
        assert stats["served_calls"] == served * len(transformer_blocks(module)), stats


def test_a_reweight_head_that_is_not_the_updates_loss_recomputes_every_call():
    config = grpo_llm.Config(prompts=2, group=4, micro_batch=4, dtype=torch.float64, schedule="reweight")
    _, native_grads = _native(DenseRewardLLM, config, 1)
    wrapped, _, grads = _run(WrongHeadLLM, config, True, steps=1)
    assert _relative(grads[0], native_grads[0]) <= 1e-10  # recomputed natively, so exact
    stats = wrapped.model.stats()
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] == 2, stats


def test_provisional_needs_the_reweight_schedule_and_a_callable():
    with pytest.raises(ValueError, match="wrap it with schedule='reweight'"):
        leancompile.wrap(torch.nn.Linear(2, 2)).provisional(lambda a: a)
    with pytest.raises(ValueError, match="head must be a callable"):
        leancompile.wrap(torch.nn.Linear(2, 2), schedule="reweight").provisional(1.0)


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_what_a_rollout_kept_is_freed_once_the_weights_change(schedule):
    """Nothing outlives its use: after an optimizer step the next rollout's first call frees every kept call of
    the last one (were any held, each step would add a rollout's activations to the process)."""
    loop = DenseRewardLLM(grpo_llm.Config(prompts=2, group=2, micro_batch=2, dtype=torch.float64,
                                          schedule=schedule))
    loop.step()
    kept = [weakref.ref(call) for call in loop.model.engine.kept]
    assert kept
    loop.step()
    gc.collect()
    assert not any(ref() is not None for ref in kept)


def test_wrapping_twice_is_refused():
    with pytest.raises(ValueError, match="already wrapped"):
        leancompile.wrap(leancompile.wrap(torch.nn.Linear(2, 2)))


def test_the_wrapped_module_reads_as_the_module():
    """The module itself, its class put behind Wrapped: what tests its class, its attributes and its keys sees the
    module's own (a peft model here)."""
    config = dataclasses.replace(flowgrpo_sd3.Config(), num_steps=2, train_steps=1)
    wrapped, native = flowgrpo_sd3.Loop(config).transformer, flowgrpo_sd3.Loop(config, use_leancompile=False)
    assert isinstance(wrapped, leancompile.Wrapped) and isinstance(wrapped, type(native.transformer))
    assert wrapped.config is wrapped.base_model.model.config
    assert list(wrapped.state_dict()) == list(native.transformer.state_dict())
    assert type(leancompile.unwrap(wrapped)) is type(native.transformer)


def test_a_loop_writing_into_a_rollout_output_does_not_change_what_is_served():
    """The rollout's output is the loop's to modify in place (a sampler scaling its velocity); what was kept is not."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    wrapped = leancompile.wrap(module)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wrapped(x).mul_(3.0)
    served = wrapped(x)
    assert wrapped.last_calls[-1].action == "served"
    torch.testing.assert_close(served, module(x), rtol=1e-12, atol=1e-12)
