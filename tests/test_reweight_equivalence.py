"""Property tests: ``optimize(t, schedule="reweight").step()`` applies exactly the native step's gradient."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.distributed.tensor import DTensor, distribute_tensor
from hypothesis import strategies as st

from leancompile import backbones, optimize
from leancompile.trainers import DanceGRPOTrainer, FlowGRPOConfig, FlowGRPOTrainer

from conftest import PromptTable, mean_reward
from test_retain_equivalence import FLOAT64_OVERRIDES, _capture_first_gradient, grpo_configs


def tied_reward(samples, prompts):
    """``mean_reward``, except that prompt 3's samples all score 1: its group's advantages are exactly zero."""
    rewards = mean_reward(samples, prompts)
    return torch.where(torch.tensor([p == 3 for p in prompts]), torch.ones_like(rewards), rewards)


@st.composite
def configurations(draw, dtype="float64"):
    config = draw(grpo_configs(dtype, max_group=4, max_accumulation=4, max_grad_norm=None, extra=dict(
        global_std=st.booleans(),
        adv_clip_max=st.sampled_from([5.0, 0.7]),  # 0.7 binds: per-sample buffers
    )))
    prompts = draw(st.sampled_from([(1, 2), (1, 3), (2,)]))  # (1, 3): a group with zero advantages
    return config, prompts


def _build(family, config, reward=tied_reward, **overrides):
    if config.dtype == "float64":
        overrides = {**FLOAT64_OVERRIDES.get(family, {}), **overrides}
    backbone = backbones.tiny(family, seed=config.seed, **overrides)
    prompts = PromptTable(backbone, seed=config.seed)
    cls = FlowGRPOTrainer if config.algorithm == "flowgrpo" else DanceGRPOTrainer
    trainer = cls(config, backbone, reward, prompts, uncond=prompts.uncond if config.use_cfg else None)
    # Move the policy off its reference (LoRA's B starts at zero; a full fine-tune's reference is a copy), so the
    # KL penalty and its gradient are not zero in the first step.
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        for p in trainer.trainable:
            shift = 0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype)
            if isinstance(p, DTensor):  # sharded by FSDP2 (tests/test_distributed.py)
                shift = distribute_tensor(shift, p.device_mesh, p.placements)
            p.add_(shift)
    return trainer


def _flat(trainer):
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


def _run_both(family, config, prompts, reward=tied_reward, **overrides):
    native = _build(family, config, reward, **overrides)
    reweight = optimize(_build(family, config, reward, **overrides), schedule="reweight")
    grads = _capture_first_gradient(native), _capture_first_gradient(reweight)
    start = _flat(native)
    stats = native.step(list(prompts)), reweight.step(list(prompts))
    return native, reweight, stats, grads, (_flat(native) - start, _flat(reweight) - start)


def _relative(a, b) -> float:
    return float((a - b).norm() / a.norm()) if a.norm() > 0 else float(b.norm())


@given(case=configurations())
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reweight_equals_native_in_float64(case):
    """SD3 without its float32 island: every configuration, bit-for-bit up to float64 rounding."""
    config, prompts = case
    native, reweight, (n_stats, r_stats), (g_native, g_reweight), (d_native, d_reweight) = \
        _run_both("sd3", config, prompts)
    assert reweight.plan.schedule == "reweight"
    assert n_stats["optimizer_steps"] == r_stats["optimizer_steps"]
    assert n_stats["reward_mean"] == r_stats["reward_mean"]
    assert abs(n_stats["loss"] - r_stats["loss"]) <= 1e-9 * max(1.0, abs(n_stats["loss"]))
    assert bool(g_native) == bool(g_reweight)
    if g_native:
        assert _relative(g_native[0], g_reweight[0]) <= 1e-10
    assert _relative(d_native, d_reweight) <= 1e-10
    # Only micro-steps before the first optimizer step of epoch 0 may be served by the rollout.
    for record in reweight.last_micro_steps:
        if record.action == "reweight":
            assert record.epoch == 0 and record.batch < config.gradient_accumulation_steps
    if config.adv_clip_max < 1:
        assert r_stats["buffer_mode"] == "per-sample"


@given(case=configurations(), family=st.sampled_from(["flux", "wan"]))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_float32_islands_bound_reweight_by_float32_rounding(case, family):
    """Flux's rotary embedding and Wan's FP32LayerNorms compute in float32 in a float64 model. Reweight sends
    the cotangent of advantage 1 through them and scales afterwards, the native update sends the scaled one:
    the two round differently there, so agreement is bounded by float32 rounding (about 1e-7 measured)."""
    config, prompts = case
    *_, (g_native, g_reweight), (d_native, d_reweight) = _run_both(family, config, prompts)
    if g_native:
        assert _relative(g_native[0], g_reweight[0]) <= 1e-5


@given(case=configurations(dtype="bf16"), family=st.sampled_from(["flux", "sd3", "wan"]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reweight_matches_native_in_bf16(case, family):
    config, prompts = case
    *_, (g_native, g_reweight), _ = _run_both(family, config, prompts)
    if g_native and g_native[0].norm() > 0:
        cosine = float(torch.nn.functional.cosine_similarity(g_native[0], g_reweight[0], dim=0))
        assert cosine >= 0.9995, f"gradient cosine {cosine:.6f}"


def _moments_config(group_size, **overrides):
    fields = dict(num_steps=3, timestep_fraction=1.0, group_size=group_size, train_batch_size=group_size,
                  sample_batch_size=1, dtype="float64", max_grad_norm=None)
    return FlowGRPOConfig(**{**fields, **overrides})


def test_moment_accumulators_hold_a_constant_number_of_buffers_as_the_group_grows():
    held = {}
    for group_size, clip in ((4, 5.0), (8, 5.0), (16, 5.0), (4, 0.5), (16, 0.5)):  # 0.5 binds: per-sample
        native, reweight, (_, stats), _, (d_native, d_reweight) = _run_both(
            "sd3", _moments_config(group_size, adv_clip_max=clip), (1,), reward=mean_reward)
        assert _relative(d_native, d_reweight) <= 1e-10
        held[group_size, clip] = (stats["buffer_mode"], stats["buffers"], stats["buffer_bytes"])
    # one sample in flight, then two sums per group (r-weighted and plain): 3 buffers whatever the group size
    assert {held[g, 5.0][:2] for g in (4, 8, 16)} == {("accumulators", 3)}
    assert len({held[g, 5.0][2] for g in (4, 8, 16)}) == 1
    assert [held[g, 0.5][:2] for g in (4, 16)] == [("per-sample", 4), ("per-sample", 16)]


def test_moments_with_kl_and_a_zero_advantage_group_equal_native():
    config = _moments_config(4, beta=0.05, train_batch_size=8, guidance_scale=2.0)
    native, reweight, (_, stats), (g_native, g_reweight), _ = _run_both("sd3", config, (1, 3))
    assert stats["buffer_mode"] == "accumulators"
    assert stats["buffers"] == 2 + 2 * 3  # two in flight (policy and KL), three sums per group
    assert _relative(g_native[0], g_reweight[0]) <= 1e-10


def batch_normalised_reward(samples, prompts):
    """A reward that depends on the whole batch: scoring a sample alone differs from scoring it with others."""
    rewards = mean_reward(samples, prompts)
    return rewards - rewards.mean() if len(rewards) > 1 else rewards


def test_a_batch_dependent_reward_makes_the_accumulators_recompute_and_stay_exact():
    native, reweight, (_, stats), (g_native, g_reweight), _ = _run_both(
        "sd3", _moments_config(4), (1,), reward=batch_normalised_reward)
    assert stats["buffer_mode"] == "accumulators" and stats["reused_micro_steps"] == 0
    assert all("alone than in the full batch" in r.reason for r in reweight.last_micro_steps)
    assert _relative(g_native[0], g_reweight[0]) <= 1e-10


@pytest.mark.parametrize("lora, via, method", [(4, "forward", "rows"), (4, "recording", "linear"),
                                              (None, "forward", "per-sample")])
def test_per_sample_gradients_of_a_rollout_micro_batch_match_one_backward_per_sample(lora, via, method):
    from leancompile.runtime.per_sample import PerSampleGradients

    trainer = _build("flux", FlowGRPOConfig(dtype="float64", lora_rank=lora))
    backbone, params = trainer.backbone, trainer.trainable
    x = torch.randn(6, *backbone.latent_shape, dtype=torch.float64)
    sigma = torch.rand(6, dtype=torch.float64)
    cond = trainer.encode([1, 2, 3, 1, 2, 3]).to(dtype=torch.float64)
    per_sample = PerSampleGradients(backbone, params)
    if via == "forward":
        out = per_sample.forward(x, sigma, cond, 3)
    else:
        with per_sample.recording(6):
            out = backbone(x, sigma, cond)
    assert per_sample.method(3) == method
    grads = per_sample.gradients(out, out.detach(), 3)  # rows i and i + 3 belong to sample i
    for i in range(3):
        rows = torch.tensor([i, i + 3])
        one = backbone(x[rows], sigma[rows], cond.index(rows))
        for g, expected in zip(grads, torch.autograd.grad(one, params, one.detach(), allow_unused=True,
                                                           materialize_grads=True)):
            torch.testing.assert_close(g[i], expected, rtol=1e-10, atol=1e-12)
