"""Bitwise Retain (``optimize(..., bitwise=True)``): in float32 and bf16 the optimized step is native's bit for bit
(rewards, the applied gradient, the weights), and where the rollout's batch is the update's micro-batch it reuses."""
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leancompile
from examples import dancegrpo_flux, grpo_llm
from examples.loop_cli import trained_module
from leancompile import optimize
from leancompile.runtime.bitwise import BitwiseRetain
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig

from test_retain_equivalence import _build, _capture_first_gradient


@st.composite
def bitwise_cases(draw, precision="float32", batch_of_one=True):
    """A backbone, a config and a requested schedule; ``batch_of_one``: the rollout's and the update's calls hold one
    sample each (DanceGRPO's batching), else the update's shuffled micro-batches regroup the rollout's samples."""
    algorithm = draw(st.sampled_from([FlowGRPOConfig, DanceGRPOConfig]))
    num_steps = draw(st.integers(2, 4))
    batching = (dict(sample_batch_size=1, train_batch_size=1) if batch_of_one
                else dict(sample_batch_size=None, train_batch_size=draw(st.integers(2, 3))))
    config = algorithm(
        num_steps=num_steps, timestep_fraction=1.0, trained_steps=draw(st.sampled_from(["first", "random"])),
        group_size=2, gradient_accumulation_steps=draw(st.integers(1, 4)),
        num_inner_epochs=draw(st.integers(1, 2)), lora_rank=draw(st.sampled_from([2, None])),
        beta=draw(st.sampled_from([0.0, 0.05])), guidance_scale=draw(st.sampled_from([1.0, 2.5])),
        learning_rate=1e-3, seed=draw(st.integers(0, 100)), dtype="float32",
        mixed_precision="bf16" if precision == "bf16" else "no", **batching)
    return draw(st.sampled_from(["flux", "sd3", "wan"])), config, draw(st.sampled_from(["retain", "auto", "reweight"]))


def _run_both(family, config, schedule):
    native = _build(family, config)
    optimized = optimize(_build(family, config), schedule=schedule, bitwise=True)
    native_grads, optimized_grads = _capture_first_gradient(native), _capture_first_gradient(optimized)
    native_stats, stats = native.step([1, 2]), optimized.step([1, 2])
    assert torch.equal(native.last_rollout.rewards, optimized.last_rollout.rewards)
    assert torch.equal(native.last_rollout.latents, optimized.last_rollout.latents)
    assert native_stats["optimizer_steps"] == stats["optimizer_steps"]
    if native_grads:
        assert torch.equal(native_grads[0], optimized_grads[0]), "first applied gradient differs"
    assert all(torch.equal(p, q) for p, q in zip(native.trainable, optimized.trainable)), "weights differ"
    return optimized, stats


@given(case=bitwise_cases())
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bitwise_retain_is_native_to_the_bit_in_float32_and_reuses(case):
    family, config, schedule = case
    optimized, stats = _run_both(family, config, schedule)
    assert optimized.plan.schedule == "retain" and optimized.plan.exactness.startswith("bitwise native")
    assert stats["served_calls"] > 0


@given(case=bitwise_cases(precision="bf16"))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bitwise_retain_is_native_to_the_bit_under_bf16_autocast(case):
    """Where native's own two phases run different operators (Flux and SD3 at a one-row call under bf16: matmul
    folds a row with grad and not without), nothing is reused and the plan says why."""
    family, config, schedule = case
    optimized, stats = _run_both(family, config, schedule)
    if optimized.plan.schedule == "native":
        assert not config.use_cfg and family in ("flux", "sd3"), optimized.plan.choice
        assert "different operators" in optimized.plan.choice or "differs" in optimized.plan.choice
    else:
        assert stats["served_calls"] > 0


@given(case=bitwise_cases(batch_of_one=False))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_regrouped_micro_batches_recompute_and_stay_bitwise(case):
    """Native's gradient of a micro-batch depends on which rows it holds and their order, so an update call that
    regroups the rollout's rows is never served: every call with grad recomputes, counted under ``batch`` (or
    ``weights`` after an optimizer step)."""
    family, config, schedule = case
    optimized, stats = _run_both(family, config, schedule)
    served = [r for r in optimized.last_calls if r.action == "served"]
    assert not served
    assert set(stats.get("recompute_reasons", {})) <= {"batch", "weights", "nothing kept", "inputs"}


def test_bitwise_refuses_reweight_and_partial_retention():
    config = FlowGRPOConfig(num_steps=2, group_size=2, train_batch_size=1, sample_batch_size=1, dtype="float32")
    plan = optimize(_build("wan", config), schedule="reweight", bitwise=True).plan
    assert plan.schedule == "retain" and "bitwise=True" in plan.refusals[0].reason
    assert optimize(_build("wan", config), schedule="retain").plan.exactness.startswith("exact in real arithmetic")
    with pytest.raises(ValueError, match="memory_budget=0.5 with bitwise=True"):
        optimize(_build("wan", config), schedule="retain", memory_budget=0.5, bitwise=True)
    with pytest.raises(ValueError, match="bitwise must be True or False"):
        optimize(_build("wan", config), bitwise="yes")


def _loop_run(module, config, bitwise: bool, steps: int = 2):
    loop = module.Loop(config, use_leancompile=False)
    if bitwise:
        name = "model" if hasattr(loop, "model") else "transformer"
        setattr(loop, name, leancompile.wrap(getattr(loop, name), bitwise=True))
    rewards = [loop.step() for _ in range(steps)]
    return rewards, [p.detach().clone() for p in trained_module(loop).parameters()], trained_module(loop)


@pytest.mark.parametrize("module, config, served", [
    (dancegrpo_flux, dancegrpo_flux.Config(num_steps=6), 2 * 4 * 3),  # one sample per call: every update call
    (grpo_llm, grpo_llm.Config(prompts=4, group=4, micro_batch=8, autocast=torch.bfloat16), 0),  # regrouped
])
def test_a_wrapped_loop_under_bitwise_retain_is_native_to_the_bit(module, config, served):
    native_rewards, native_weights, _ = _loop_run(module, config, False)
    rewards, weights, wrapped = _loop_run(module, config, True)
    assert rewards == native_rewards
    assert all(torch.equal(a, b) for a, b in zip(native_weights, weights))
    stats = wrapped.stats()
    assert stats["served_calls"] == served, stats
    if not served:
        assert stats["recompute_reasons"] == {"batch": stats["recomputed_calls"]}


def test_wrap_bitwise_needs_retain():
    with pytest.raises(ValueError, match="bitwise=True keeps eager graphs"):
        leancompile.wrap(torch.nn.Linear(2, 2), schedule="reweight", bitwise=True)


def test_kept_graphs_are_freed_at_the_end_of_the_step():
    """Regrouped micro-batches serve nothing: every activation the rollout's kept graphs saved must still be freed
    (an operator's output saved with its own grad_fn would otherwise hold its graph in a reference cycle through
    C++, which no collector frees)."""
    config = FlowGRPOConfig(num_steps=2, group_size=2, train_batch_size=2, dtype="float32", guidance_scale=2.5)
    optimized = optimize(_build("sd3", config), schedule="retain", bitwise=True)
    storages, pack = [], BitwiseRetain.pack

    def recording(weights, saved, t):
        if t.untyped_storage().data_ptr() not in weights:
            storages.append(StorageWeakRef(t.untyped_storage()))
        return pack(weights, saved, t)

    BitwiseRetain.pack = staticmethod(recording)
    try:
        optimized.step([1, 2])
    finally:
        BitwiseRetain.pack = staticmethod(pack)
    gc.collect()
    assert storages and all(ref.expired() for ref in storages)
