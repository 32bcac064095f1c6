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

__all__ = ["DigitsClassifierReward", "JpegCompressibilityReward", "digits_classifier"]

_CLASSIFIER = None
_CLASSIFIER_LOCK = threading.Lock()


def digits_classifier():
    """The fitted digits classifier, trained once per process.

    Input features are the flattened 8x8 images divided by 16 (the digits' 0-16 scale mapped to
    [0, 1]); ``predict_proba`` columns are the classes 0..9 in order.
    """
    global _CLASSIFIER
    with _CLASSIFIER_LOCK:
        if _CLASSIFIER is None:
            from sklearn.datasets import load_digits
            from sklearn.linear_model import LogisticRegression

            data = load_digits()
            # lbfgs on a fixed dataset is deterministic; C is loose enough that clean digits get
            # confident probabilities but blurry samples do not, which is what leaves RL headroom.
            clf = LogisticRegression(C=1.0, max_iter=5000)
            clf.fit(data.data / 16.0, data.target)
            _CLASSIFIER = clf
        return _CLASSIFIER


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

    def __init__(self, target: int | None = None):
        if target is not None and not 0 <= int(target) <= 9:
            raise ValueError(f"target must be a digit class 0-9, got {target}")
        self.target = None if target is None else int(target)
        self.classifier = digits_classifier()

    def __call__(self, samples: torch.Tensor, prompts: Sequence | torch.Tensor | None = None) -> torch.Tensor:
        x = _check_samples(samples)
        batch = x.shape[0]
        if self.target is not None:
            classes = np.full(batch, self.target, dtype=np.int64)
        else:
            if prompts is None:
                raise ValueError("prompts are required when no target class is set")
            classes = _prompt_classes(prompts, batch)
        # [-1, 1] latents -> the digits' 0-16 scale -> the classifier's [0, 1] features.
        feats = ((x.reshape(batch, 64).numpy() + 1.0) * 8.0) / 16.0
        proba = self.classifier.predict_proba(feats)
        return torch.from_numpy(proba[np.arange(batch), classes].astype(np.float32))


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
