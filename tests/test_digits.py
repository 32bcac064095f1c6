"""The digits task: shipped checkpoint, sampling quality, rewards and image helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from leancompile.backbones import Backbone, Conditioning
from leancompile.tasks import digits
from leancompile.tasks import rewards
from leancompile.tasks.rewards import DigitsClassifierReward, DigitsJudge, JpegCompressibilityReward

# Measured on the shipped checkpoint: 10-step Euler, no guidance, gives a mean reward well below
# this, so GRPO has something to improve; guidance 2 classifies almost perfectly.
NO_CFG_REWARD_CEILING = 0.95


@pytest.fixture(scope="module")
def model():
    return digits.load_pretrained()


@pytest.fixture(scope="module")
def reward():
    return DigitsClassifierReward()


def _balanced_prompts(per_class: int) -> list[int]:
    return [k for k in range(digits.NUM_CLASSES) for _ in range(per_class)]


def test_checkpoint_is_small_float16_and_documented():
    path = digits.CHECKPOINT_PATH
    assert path.exists()
    assert path.stat().st_size <= 5 * 1024 * 1024
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())
        assert "class_embed.weight" in f.keys()
    assert json.loads(meta["config"]) == digits.DIGITS_CONFIG
    info = digits.checkpoint_info()
    assert info["metrics"]["cfg2"]["accuracy"] >= 0.9
    assert info["settings"]["config"] == digits.DIGITS_CONFIG


def test_load_pretrained_structure(model):
    assert isinstance(model.backbone, Backbone)
    assert model.backbone.family == "sd3"
    assert model.backbone.latent_shape == digits.LATENT_SHAPE
    assert not model.class_embed.weight.requires_grad
    assert all(p.requires_grad for p in model.backbone.parameters())
    cond = model.encode([0, 3, digits.NULL_CLASS])
    assert isinstance(cond, Conditioning)
    assert cond.text.shape == (3, 1, 64) and cond.pooled.shape == (3, 64)
    same = model.encode(torch.tensor([0, 3, digits.NULL_CLASS]))
    assert torch.equal(cond.text, same.text)
    with pytest.raises(ValueError, match="prompts"):
        model.encode([11])


def test_load_pretrained_dtype():
    m = digits.load_pretrained(dtype=torch.bfloat16)
    assert m.class_embed.weight.dtype == torch.bfloat16
    assert next(m.backbone.parameters()).dtype == torch.bfloat16


def test_guided_samples_are_classified_correctly(model, reward):
    labels = _balanced_prompts(5)
    x = digits.sample(model, labels, steps=10, guidance=2.0, generator=torch.Generator().manual_seed(123))
    assert x.shape == (50, 1, 8, 8)
    feats = ((x.clamp(-1, 1).reshape(50, 64) + 1.0) * 8.0 / 16.0).numpy()
    acc = (reward.classifier.predict(feats) == np.array(labels)).mean()
    assert acc >= 0.9


def test_unguided_samples_leave_reward_headroom(model, reward):
    labels = _balanced_prompts(5)
    x = digits.sample(model, labels, steps=10, guidance=1.0, generator=torch.Generator().manual_seed(123))
    r = reward(x, labels)
    assert r.shape == (50,) and r.dtype == torch.float32
    assert 0.3 < float(r.mean()) < NO_CFG_REWARD_CEILING


def _half_images(part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One half of the digits as (N, 1, 8, 8) images in [-1, 1] and their labels."""
    features, labels = rewards.digits_half(part)
    return torch.from_numpy(features).float().reshape(-1, *digits.LATENT_SHAPE) * 2 - 1, torch.from_numpy(labels)


def test_classifier_reward_on_real_digits(reward):
    # The images the reward's classifier was fit on (the judge's half is held out from it).
    x, y = _half_images("reward")
    for k in range(10):
        xk = x[y == k][:20]
        r = reward(xk, [k] * len(xk))
        assert float(r.mean()) > 0.8
        wrong = reward(xk, [(k + 1) % 10] * len(xk))
        assert float(wrong.mean()) < 0.1
    # A fixed target ignores the prompts.
    xs = x[y == 7][:10]
    assert torch.equal(DigitsClassifierReward(target=7)(xs, [0] * 10), reward(xs, [7] * 10))
    assert torch.equal(reward(xs, torch.full((10,), 7)), reward(xs, [7] * 10))


def test_classifier_is_cached():
    assert DigitsClassifierReward().classifier is DigitsClassifierReward().classifier
    assert DigitsJudge().classifier is DigitsJudge().classifier


def _rows(x: np.ndarray) -> set[bytes]:
    """The rows of ``x`` as a set (exact values: the digits' 0-16 scale divides exactly)."""
    return {row.tobytes() for row in np.asarray(x, dtype=np.float64)}


def test_reward_and_judge_halves_split_the_digits():
    (x_reward, y_reward), (x_judge, y_judge) = rewards.digits_half("reward"), rewards.digits_half("judge")
    x, y = digits.load_digit_images()
    # The halves hold every image once between them, in the classifiers' [0, 1] features.
    assert len(x_reward) + len(x_judge) == len(x)
    assert _rows(x_reward) | _rows(x_judge) == _rows(((x.reshape(-1, 64) + 1) / 2).numpy())
    assert not _rows(x_reward) & _rows(x_judge)
    # Each half holds every digit about equally often.
    for labels in (y_reward, y_judge):
        assert np.bincount(labels, minlength=10).min() >= 0.09 * len(labels)
    with pytest.raises(ValueError, match="part"):
        rewards.digits_half("test")


def test_judge_never_saw_the_reward_half():
    x_reward, _ = rewards.digits_half("reward")
    x_judge, _ = rewards.digits_half("judge")
    svm = rewards.digits_judge().calibrated_classifiers_[0].estimator
    assert _rows(svm.support_vectors_) <= _rows(x_judge)
    assert not _rows(svm.support_vectors_) & _rows(x_reward)


def test_judge_and_reward_classify_the_half_they_never_saw():
    (x_reward, y_reward), (x_judge, y_judge) = rewards.digits_half("reward"), rewards.digits_half("judge")
    judge, classifier = rewards.digits_judge(), rewards.digits_classifier()
    assert (judge.predict(x_reward) == y_reward).mean() > 0.9
    assert (classifier.predict(x_judge) == y_judge).mean() > 0.9
    # A second opinion, not a copy of the reward's: the two models' probabilities differ.
    assert np.abs(judge.predict_proba(x_reward) - classifier.predict_proba(x_reward)).max() > 0.1


def test_judge_is_deterministic():
    x_reward, _ = rewards.digits_half("reward")
    assert np.array_equal(rewards._fit_judge().predict_proba(x_reward), rewards._fit_judge().predict_proba(x_reward))


def test_judge_scores_like_a_reward():
    x, y = _half_images("reward")  # images the judge never saw
    threes = x[y == 3][:20]
    judge = DigitsJudge(target=3)
    proba = judge.predict_proba(threes)
    assert proba.shape == (20, 10) and np.allclose(proba.sum(axis=1), 1)
    assert torch.equal(judge(threes), torch.from_numpy(proba[:, 3].astype(np.float32)))
    assert float(judge(threes).mean()) > 0.8
    assert float(DigitsJudge(target=5)(threes).mean()) < 0.1


def test_jpeg_reward_prefers_constant_images():
    jpeg = JpegCompressibilityReward()
    const = torch.zeros(4, 1, 8, 8)
    noise = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    rc, rn = jpeg(const, [0] * 4), jpeg(noise, [0] * 4)
    assert rc.shape == (4,) and rc.dtype == torch.float32
    assert bool((rc < 0).all()) and bool((rc > rn).all())


def test_rewards_reject_bad_shapes(reward):
    jpeg = JpegCompressibilityReward()
    for bad in (torch.zeros(2, 8, 8), torch.zeros(2, 3, 8, 8), torch.zeros(2, 1, 16, 16)):
        with pytest.raises(ValueError, match="samples"):
            reward(bad, [0, 1])
        with pytest.raises(ValueError, match="samples"):
            jpeg(bad, [0, 1])
    with pytest.raises(ValueError, match="prompts"):
        reward(torch.zeros(2, 1, 8, 8), [0, 1, 2])
    with pytest.raises(ValueError, match="target"):
        DigitsClassifierReward(target=12)


def test_random_init_is_seeded():
    a, b, c = digits.random_init(1), digits.random_init(1), digits.random_init(2)
    pa, pb, pc = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert isinstance(a.backbone, Backbone) and not a.class_embed.weight.requires_grad


def test_prompts_images_and_grid(tmp_path):
    p = digits.prompts(16, torch.Generator().manual_seed(0))
    assert len(p) == 16 and all(isinstance(k, int) and 0 <= k <= 9 for k in p)
    assert p == digits.prompts(16, torch.Generator().manual_seed(0))
    x = torch.linspace(-2, 2, 3 * 64).reshape(3, 1, 8, 8)
    imgs = digits.to_images(x)
    assert imgs.shape == (3, 8, 8) and imgs.dtype == np.uint8
    assert imgs.min() == 0 and imgs.max() == 255
    from PIL import Image

    out = digits.save_grid(x, tmp_path / "grid.png", nrow=2, scale=4)
    with Image.open(out) as im:
        assert im.size == ((2 * 9 + 1) * 4, (2 * 9 + 1) * 4)
