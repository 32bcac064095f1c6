"""Rewards for the digits task.

A reward is a plain callable ``reward(samples, prompts) -> Tensor (B,) float32`` where
``samples`` are (B, 1, 8, 8) latents in about [-1, 1]. Rewards are computed outside the
autograd graph (GRPO only needs their values), so they may use numpy, scikit-learn and PIL.
"""

from __future__ import annotations

import io
import threading
from typing import Sequence

import numpy as np
import torch

__all__ = ["DigitsClassifierReward", "DigitsJudge", "JpegCompressibilityReward", "digits_classifier", "digits_half",
           "digits_judge"]

_FITTED: dict = {}
_FIT_LOCK = threading.Lock()


def digits_half(part: str) -> tuple[np.ndarray, np.ndarray]:
    """One half of scikit-learn's digits as classifier features and labels: ``"reward"`` the even rows,
    ``"judge"`` the odd ones.

    Features are the flattened 8x8 images divided by 16 (the digits' 0-16 scale mapped to [0, 1]). The rows
    cycle through the classes, so each half holds every digit about equally often.
    """
    if part not in ("reward", "judge"):
        raise ValueError(f"part must be 'reward' or 'judge'; got {part!r}")
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = slice(0, None, 2) if part == "reward" else slice(1, None, 2)
    return data.data[rows] / 16.0, data.target[rows]


def _fitted(fit):
    """``fit()``, run once per process."""
    with _FIT_LOCK:
        if fit not in _FITTED:
            _FITTED[fit] = fit()
        return _FITTED[fit]


def _fit_classifier():
    from sklearn.linear_model import LogisticRegression

    # lbfgs on a fixed dataset is deterministic; C is loose enough that clean digits get
    # confident probabilities but blurry samples do not, which is what leaves RL headroom.
    return LogisticRegression(C=1.0, max_iter=5000).fit(*digits_half("reward"))


def _fit_judge():
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.svm import SVC

    # Another model family on other images: a sample that exploits the reward's linear classifier need not
    # fool it. C and gamma are the best of a 5-fold cross-validation on the judge's half alone; the calibration
    # folds are unshuffled, so the fit is deterministic.
    return CalibratedClassifierCV(SVC(C=10.0, gamma=0.2), ensemble=False).fit(*digits_half("judge"))


def digits_classifier():
    """The reward's digits classifier (logistic regression on the ``"reward"`` half), fitted once per process.

    Input features are those of :func:`digits_half`; ``predict_proba`` columns are the classes 0..9 in order.
    """
    return _fitted(_fit_classifier)


def digits_judge():
    """An independent digits classifier (an RBF support vector machine on the ``"judge"`` half, which the
    reward's classifier never saw), fitted once per process; same features and columns as the reward's."""
    return _fitted(_fit_judge)


def _check_samples(samples: torch.Tensor) -> torch.Tensor:
    if not isinstance(samples, torch.Tensor) or samples.dim() != 4 or tuple(samples.shape[1:]) != (1, 8, 8):
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"samples must be a (B, 1, 8, 8) tensor, got {shape}")
    return samples.detach().to(device="cpu", dtype=torch.float32).clamp(-1.0, 1.0)


def _prompt_classes(prompts, batch: int) -> np.ndarray:
    if isinstance(prompts, torch.Tensor):
        arr = prompts.detach().cpu().reshape(-1).numpy()
    else:
        arr = np.asarray([int(p) for p in prompts])
    if arr.shape != (batch,):
        raise ValueError(f"prompts must hold one class per sample ({batch}), got {arr.shape[0]}")
    if arr.size and (arr.min() < 0 or arr.max() > 9):
        raise ValueError("prompts must be digit classes 0-9")
    return arr.astype(np.int64)


class DigitsClassifierReward:
    """Probability the digits classifier assigns to the prompted class (or to ``target``)."""

    fitted_classifier = staticmethod(digits_classifier)

    def __init__(self, target: int | None = None):
        if target is not None and not 0 <= int(target) <= 9:
            raise ValueError(f"target must be a digit class 0-9, got {target}")
        self.target = None if target is None else int(target)
        self.classifier = self.fitted_classifier()

    def predict_proba(self, samples: torch.Tensor) -> np.ndarray:
        """The classifier's (B, 10) class probabilities of the samples."""
        x = _check_samples(samples)
        # [-1, 1] latents -> the digits' 0-16 scale -> the classifier's [0, 1] features.
        return self.classifier.predict_proba(((x.reshape(x.shape[0], 64).numpy() + 1.0) * 8.0) / 16.0)

    def __call__(self, samples: torch.Tensor, prompts: Sequence | torch.Tensor | None = None) -> torch.Tensor:
        proba = self.predict_proba(samples)
        batch = proba.shape[0]
        if self.target is not None:
            classes = np.full(batch, self.target, dtype=np.int64)
        else:
            if prompts is None:
                raise ValueError("prompts are required when no target class is set")
            classes = _prompt_classes(prompts, batch)
        return torch.from_numpy(proba[np.arange(batch), classes].astype(np.float32))


class DigitsJudge(DigitsClassifierReward):
    """The same probability from :func:`digits_judge`, a classifier the reward never saw: a reward gain the
    judge does not share is a gain on the reward's classifier rather than on the digit."""

    fitted_classifier = staticmethod(digits_judge)


class JpegCompressibilityReward:
    """Negative JPEG size in kB of each image: more compressible scores higher."""

    def __init__(self, upscale: int = 4, quality: int = 95):
        self.upscale = int(upscale)
        self.quality = int(quality)

    def __call__(self, samples: torch.Tensor, prompts: Sequence | None = None) -> torch.Tensor:
        from PIL import Image

        x = _check_samples(samples)
        pixels = ((x[:, 0] + 1.0) * 127.5).round().to(torch.uint8).numpy()
        out = np.empty(len(pixels), dtype=np.float32)
        for i, img in enumerate(pixels):
            # Upscaling first makes the size depend on image structure rather than fixed header bytes.
            big = np.kron(img, np.ones((self.upscale, self.upscale), dtype=np.uint8))
            buf = io.BytesIO()
            Image.fromarray(big).save(buf, format="JPEG", quality=self.quality)
            out[i] = -buf.tell() / 1000.0
        return torch.from_numpy(out)
