"""On a CUDA device: every schedule of ``optimize`` and ``leancompile.wrap`` train exactly what native trains there
(float64), close to it under bf16 autocast, with every tensor they make on the trainer's device. Skipped where there
is no CUDA device (``benchmarks/gpu.sh`` runs this file first)."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.loop_cli import trained_module
from leancompile import optimize
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig

from test_drop_in import LOOPS, _relative, _run
from test_retain_equivalence import _build as build_trainer, _capture_first_gradient, grpo_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def _tolerance(family, schedule) -> float:
    """Float64 rounding, except where Reweight (auto may choose it) meets Flux's rotary embedding or Wan's
    FP32LayerNorms, which compute in float32 whatever the model's dtype (test_reweight_equivalence: bounded by
    float32 rounding)."""
    return 1e-5 if family in ("flux", "wan") and schedule != "retain" else 1e-10


def _build(family, config, **overrides):
    return build_trainer(family, config, CUDA, **overrides)


def _first_update(trainer) -> tuple[torch.Tensor, dict]:
    """The gradient the first optimizer step applies (on the device), and the step's stats."""
    grads = _capture_first_gradient(trainer)
    stats = trainer.step([1, 2])
    assert grads[0].device.type == "cuda"
    return grads[0], stats


FLOWGRPO = FlowGRPOConfig(num_steps=3, timestep_fraction=1.0, group_size=2, train_batch_size=2,
                          gradient_accumulation_steps=2, guidance_scale=2.5, beta=0.05, lora_rank=2, dtype="float64")
DANCEGRPO = DanceGRPOConfig(num_steps=4, group_size=2, train_batch_size=1, sample_batch_size=1,
                            gradient_accumulation_steps=4, dtype="float64")


@pytest.mark.parametrize("schedule", ["retain", "reweight", "auto"])
@pytest.mark.parametrize("config", [FLOWGRPO, DANCEGRPO], ids=["flowgrpo", "dancegrpo"])
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_every_schedule_on_cuda_applies_native_gradient(family, config, schedule):
    native_grad, _ = _first_update(_build(family, config))
    optimized = optimize(_build(family, config), schedule=schedule)
    grad, stats = _first_update(optimized)
    assert _relative(grad, native_grad) <= _tolerance(family, schedule)
    assert stats["served_calls"] > 0, optimized.plan


@given(config=grpo_configs(), family=st.sampled_from(["flux", "sd3", "wan"]),
       schedule=st.sampled_from(["retain", "reweight", "auto"]))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_configuration_on_cuda_trains_as_native(config, family, schedule):
    native_grad, _ = _first_update(_build(family, config))
    grad, _ = _first_update(optimize(_build(family, config), schedule=schedule))
    if native_grad.norm() > 0:
        assert _relative(grad, native_grad) <= _tolerance(family, schedule)
    else:
        assert float(grad.norm()) <= 1e-14


# Under bf16 autocast CUDA's attention runs cuDNN's kernels; at the tiny models' head size of 16 their backward gave
# NaN gradients in the native trainer itself (H200, torch 2.11), so this test uses heads of 64, as the real models do.
WIDE_HEADS = {"flux": dict(attention_head_dim=64, axes_dims_rope=(8, 28, 28)),
              "sd3": dict(attention_head_dim=64, caption_projection_dim=128),  # the projection is as wide as the heads
              "wan": dict(attention_head_dim=64)}


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_bf16_autocast_on_cuda_keeps_the_gradient(family, schedule):
    config = dataclasses.replace(FLOWGRPO, dtype="float32", mixed_precision="bf16")
    native_grad, _ = _first_update(_build(family, config, **WIDE_HEADS[family]))
    assert torch.isfinite(native_grad).all()
    grad, _ = _first_update(optimize(_build(family, config, **WIDE_HEADS[family]), schedule=schedule))
    cosine = float(torch.nn.functional.cosine_similarity(grad, native_grad, dim=0))
    assert cosine >= 0.999, f"gradient cosine {cosine:.6f}"


@pytest.mark.parametrize("name", LOOPS)
def test_a_wrapped_loop_on_cuda_trains_exactly_as_its_native_version(name):
    loop_class, config, served = LOOPS[name]
    config = dataclasses.replace(config, device="cuda")
    _, native_rewards, native_grads = _run(loop_class, config, False)
    wrapped, rewards, grads = _run(loop_class, config, True)
    assert rewards == pytest.approx(native_rewards, rel=1e-10)
    assert all(g.device.type == "cuda" for g in grads)
    for g, g_native in zip(grads, native_grads, strict=True):
        assert _relative(g, g_native) <= 1e-10
    assert trained_module(wrapped).stats()["served_calls"] == served


def test_the_digest_on_cuda_gives_the_cpus_integers_and_sees_one_changed_byte():
    """CUDA's digest by int8 products (:mod:`leancompile.runtime.digest`) computes the integers the CPU computes
    with ``weighted=True`` (the same rows, matrix and weights), whichever of int8 or float32 products the device
    takes, on tensors read in place and copied into buckets alike; one flipped byte changes its tensor's alone."""
    from leancompile.runtime import digest as module

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(512, 256, generator=generator), torch.randn(100, 333, generator=generator),
               torch.randn(7, generator=generator).to(torch.bfloat16)]
    on_cpu = module.digest(tensors, weighted=True)
    on_cuda = module.digest([t.to(CUDA) for t in tensors])
    assert on_cuda.device.type == "cuda" and torch.equal(on_cuda.cpu(), on_cpu)
    changed = [t.to(CUDA) for t in tensors]
    changed[0].view(-1).view(torch.uint8)[12345] ^= 1
    after = module.digest(changed).cpu()
    assert after[0] != on_cpu[0] and torch.equal(after[1:], on_cpu[1:])
