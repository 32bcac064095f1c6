"""Native trainers: determinism, schedules, optimizer boundaries, LoRA and full fine-tuning, errors."""
import math

import pytest
import torch

from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig

FAMILIES = ["flux", "sd3", "wan"]


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.backbone.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("algorithm", ["flowgrpo", "dancegrpo"])
@pytest.mark.parametrize("lora", [True, False])
def test_a_step_trains_exactly_the_trainable_weights(make_trainer, family, algorithm, lora):
    common = dict(num_steps=3, group_size=2, lora_rank=2 if lora else None, learning_rate=1e-3)
    config = FlowGRPOConfig(**common) if algorithm == "flowgrpo" else DanceGRPOConfig(**common)
    trainer = make_trainer(config, family=family)
    before = _weights(trainer)
    stats = trainer.step([1, 2])
    after = trainer.backbone.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    trainable = {n for n, p in trainer.backbone.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable
    if lora:
        assert all("lora_" in n for n in trainable)
    else:
        assert trainable == {n for n, _ in trainer.backbone.named_parameters()}
    assert math.isfinite(stats["loss"]) and stats["optimizer_steps"] >= 1


def test_two_runs_with_one_seed_are_bitwise_identical(make_trainer):
    config = FlowGRPOConfig(num_steps=3, group_size=2, guidance_scale=2.0, beta=0.01, ema=True,
                            train_batch_size=3, num_inner_epochs=2)
    runs = []
    for _ in range(2):
        trainer = make_trainer(config)
        stats = [trainer.step([1, 2]) for _ in range(2)]
        for s in stats:
            for key in ("rollout_seconds", "update_seconds", "step_seconds"):
                s.pop(key)
        runs.append((stats, _weights(trainer), trainer.ema_parameters()))
    (s0, w0, e0), (s1, w1, e1) = runs
    assert s0 == s1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert e0 and all(torch.equal(e0[k], e1[k]) for k in e0)


@pytest.mark.parametrize("batch, accum, epochs, expected", [(1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 1, 2), (3, 1, 2, 4),
                                                              (1, 3, 1, 2)])
def test_optimizer_steps_follow_accumulation_and_epochs(make_trainer, batch, accum, epochs, expected):
    config = DanceGRPOConfig(num_steps=3, group_size=2, train_batch_size=batch,
                             gradient_accumulation_steps=accum, num_inner_epochs=epochs)
    trainer = make_trainer(config)
    calls = []
    original = trainer.optimizer_step
    trainer.optimizer_step = lambda: (calls.append(1), original())
    stats = trainer.step([1, 2])  # 4 samples
    assert stats["optimizer_steps"] == expected == len(calls)


def test_trained_step_schedules(make_trainer):
    first = make_trainer(FlowGRPOConfig(num_steps=10, timestep_fraction=0.99, group_size=2))
    rollout = first.rollout([1])
    assert first.trained_step_schedule(rollout.num_samples, rollout.sde_steps).tolist() == [list(range(9))] * 2

    dance = make_trainer(DanceGRPOConfig(num_steps=16, timestep_fraction=0.6, group_size=3))
    rollout = dance.rollout([1])
    schedule = dance.trained_step_schedule(rollout.num_samples, rollout.sde_steps)
    assert schedule.shape == (3, 9)  # int(15 * 0.6) = 9 per sample
    assert all(len(set(row)) == 9 and max(row) < 16 for row in schedule.tolist())
    assert len({tuple(row) for row in schedule.tolist()}) > 1  # drawn per sample

    window = make_trainer(FlowGRPOConfig(num_steps=8, sde_window_size=3, trained_steps="window", group_size=2))
    rollout = window.rollout([1])
    steps = rollout.sde_steps.nonzero().flatten()
    assert len(steps) == 3 and (steps[1:] - steps[:-1]).tolist() == [1, 1]
    assert window.trained_step_schedule(rollout.num_samples, rollout.sde_steps).tolist() == [steps.tolist()] * 2
    assert bool((rollout.log_probs[:, ~rollout.sde_steps] == 0).all())


def test_zero_variance_groups_are_dropped_without_nan(make_trainer):
    constant = lambda samples, prompts: torch.ones(len(prompts))
    trainer = make_trainer(FlowGRPOConfig(num_steps=2, group_size=2), reward=constant)
    before = _weights(trainer)
    stats = trainer.step([1, 2])
    assert stats["kept_fraction"] == 0.0 and stats["optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.backbone.state_dict().items())


def test_ema_tracks_the_trainable_weights(make_trainer):
    trainer = make_trainer(FlowGRPOConfig(num_steps=2, group_size=2, ema=True, ema_decay=0.5, learning_rate=1e-2))
    start = {k: v.clone() for k, v in trainer.trainable_state().items()}
    trainer.step([1])  # one optimizer step: ema = 0.5 * start + 0.5 * new
    assert trainer.optimizer_steps == 1
    for name, value in trainer.ema_parameters().items():
        torch.testing.assert_close(value, 0.5 * start[name] + 0.5 * trainer.trainable_state()[name])


def test_kl_to_reference_is_zero_at_lora_init_and_positive_after_training(make_trainer):
    trainer = make_trainer(FlowGRPOConfig(num_steps=2, group_size=2, beta=0.1, learning_rate=1e-2, train_batch_size=4))
    assert trainer.step([1, 2])["kl"] == 0.0  # LoRA B starts at zero: policy == reference
    assert trainer.step([1, 2])["kl"] > 0


def test_bf16_autocast_and_float64_runs(make_trainer):
    for config in (FlowGRPOConfig(num_steps=2, group_size=2, mixed_precision="bf16"),
                   FlowGRPOConfig(num_steps=2, group_size=2, dtype="float64")):
        stats = make_trainer(config).step([1])
        assert math.isfinite(stats["loss"])


@pytest.mark.parametrize("field, value, message", [
    ("timestep_fraction", 0.0, r"timestep_fraction must be in \(0, 1\]"),
    ("timestep_fraction", 1.5, r"timestep_fraction must be in \(0, 1\]"),
    ("group_size", 1, "group_size must be an integer >= 2"),
    ("clip_range", 0.0, "clip_range must be > 0"),
    ("num_steps", 0, "num_steps must be an integer >= 1"),
    ("train_batch_size", 0, "train_batch_size must be an integer >= 1"),
    ("trained_steps", "last", "trained_steps must be one of"),
    ("mixed_precision", "fp8", "mixed_precision must be"),
    ("sde_window_size", 11, "sde_window_size must be in"),
    ("lora_rank", 0, "lora_rank must be None"),
])
def test_invalid_configs_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        FlowGRPOConfig(**{"num_steps": 10, field: value})


def test_bad_trainer_inputs_raise_clear_errors(make_trainer):
    with pytest.raises(ValueError, match="uncond"):
        from leancompile import backbones
        from leancompile.trainers import FlowGRPOTrainer
        FlowGRPOTrainer(FlowGRPOConfig(guidance_scale=3.0), backbones.tiny("sd3"), None, None)
    with pytest.raises(TypeError, match="config must be a DanceGRPOConfig"):
        from leancompile.trainers import DanceGRPOTrainer
        DanceGRPOTrainer(FlowGRPOConfig(), backbones.tiny("sd3"), None, None)
    bad = lambda samples, prompts: torch.tensor([0.0, float("nan"), 1.0, 2.0])
    with pytest.raises(ValueError, match=r"non-finite rewards for samples \[1\]"):
        make_trainer(FlowGRPOConfig(num_steps=2, group_size=2), reward=bad).step([1, 2])
    trainer = make_trainer(FlowGRPOConfig(num_steps=2, group_size=2))
    trainer.encode = wrong_width
    with pytest.raises(ValueError, match="cond.text: expected shape"):
        trainer.step([1])
    with pytest.raises(ValueError, match="at least one prompt"):
        make_trainer(FlowGRPOConfig(num_steps=2, group_size=2)).step([])


def wrong_width(prompts):
    from leancompile.backbones import Conditioning
    return Conditioning(torch.zeros(len(prompts), 8, 7), torch.zeros(len(prompts), 16))
