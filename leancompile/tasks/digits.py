"""The embedded default task: class-conditional 8x8 digits with a tiny SD3 transformer.

Images are scikit-learn's ``load_digits`` (0-16 scale) mapped to [-1, 1], shape (1, 8, 8).
Conditioning is a learned class embedding (10 digits plus a null class for classifier-free
guidance) used both as a single text token and as the pooled vector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

__all__ = [
    "DIGITS_CONFIG",
    "NULL_CLASS",
    "NUM_CLASSES",
    "LATENT_SHAPE",
    "TEXT_SHAPE",
    "POOLED_DIM",
    "CHECKPOINT_PATH",
    "DigitsModel",
    "build_model",
    "load_pretrained",
    "checkpoint_info",
    "random_init",
    "prompts",
    "sample",
    "load_digit_images",
    "to_images",
    "save_grid",
]

DIGITS_CONFIG = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 1,
    "out_channels": 1,
    "num_layers": 4,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    # Must equal the hidden size (heads * head_dim) for the joint blocks.
    "caption_projection_dim": 128,
    "pooled_projection_dim": 64,
    "pos_embed_max_size": 8,
}
NUM_CLASSES = 10
NULL_CLASS = 10
LATENT_SHAPE = (1, 8, 8)
TEXT_SHAPE = (1, 64)
POOLED_DIM = 64

_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CHECKPOINT_PATH = _DATA_DIR / "digits_sd3.safetensors"
_EMBED_KEY = "class_embed.weight"
_MODEL_PREFIX = "model."


class DigitsModel(nn.Module):
    """A backbone plus the frozen class embedding that turns prompts into its conditioning."""

    def __init__(self, backbone: nn.Module, class_embed: nn.Embedding):
        super().__init__()
        self.backbone = backbone
        self.class_embed = class_embed
        # GRPO adapts the backbone only; the prompt encoder stays fixed like a text encoder.
        self.class_embed.requires_grad_(False)

    def encode(self, prompts: Sequence[int] | torch.Tensor):
        """Conditioning for digit classes 0-9 or ``NULL_CLASS``: text (B, 1, 64), pooled (B, 64)."""
        from leancompile.backbones import Conditioning

        weight = self.class_embed.weight
        if isinstance(prompts, torch.Tensor):
            idx = prompts.to(device=weight.device, dtype=torch.long).reshape(-1)
        else:
            idx = torch.tensor([int(p) for p in prompts], dtype=torch.long, device=weight.device)
        if idx.numel() and (idx.min() < 0 or idx.max() > NULL_CLASS):
            raise ValueError(f"prompts must be classes 0-{NUM_CLASSES - 1} or NULL_CLASS ({NULL_CLASS})")
        emb = self.class_embed(idx)
        return Conditioning(text=emb[:, None, :], pooled=emb)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, prompts) -> torch.Tensor:
        return self.backbone(x, sigma, self.encode(prompts))


def build_model() -> DigitsModel:
    """The digits architecture with default (random) initialisation from the global RNG."""
    from leancompile.backbones import build

    backbone = build(
        "sd3", dict(DIGITS_CONFIG), LATENT_SHAPE, TEXT_SHAPE, POOLED_DIM, device="cpu", dtype=torch.float32
    )
    return DigitsModel(backbone, nn.Embedding(NUM_CLASSES + 1, TEXT_SHAPE[1]))


def load_pretrained(dtype: torch.dtype = torch.float32, path: str | Path | None = None) -> DigitsModel:
    """The shipped rectified-flow checkpoint (stored in float16), cast to ``dtype``."""
    from safetensors.torch import load_file

    path = Path(path) if path is not None else CHECKPOINT_PATH
    state = load_file(str(path))
    # The random init is overwritten; forking keeps the caller's RNG stream unaffected by it.
    with torch.random.fork_rng(devices=[]):
        model = build_model()
    model.class_embed.weight.data.copy_(state.pop(_EMBED_KEY).float())
    model_state = {k[len(_MODEL_PREFIX):]: v.float() for k, v in state.items() if k.startswith(_MODEL_PREFIX)}
    model.backbone.model.load_state_dict(model_state, strict=True)
    return model.to(dtype).eval()


def random_init(seed: int, dtype: torch.dtype = torch.float32) -> DigitsModel:
    """The same architecture, randomly initialised from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model()
    return model.to(dtype).eval()


def checkpoint_info(path: str | Path | None = None) -> dict:
    """Training settings and metrics recorded next to the checkpoint."""
    path = Path(path) if path is not None else CHECKPOINT_PATH.with_suffix(".json")
    return json.loads(Path(path).read_text())


def prompts(n: int, generator: torch.Generator | None = None) -> list[int]:
    """``n`` random digit classes."""
    return torch.randint(0, NUM_CLASSES, (n,), generator=generator).tolist()


@torch.no_grad()
def sample(
    model: DigitsModel,
    prompts: Sequence[int] | torch.Tensor,
    steps: int = 10,
    guidance: float = 2.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Euler sampling of the flow from sigma=1 (noise) to 0 with classifier-free guidance.

    ``guidance`` 1 is the plain conditional model; larger values extrapolate away from the null class.
    """
    weight = model.class_embed.weight
    n = len(prompts)
    if noise is None:
        noise = torch.randn((n, *LATENT_SHAPE), generator=generator)
    x = noise.to(device=weight.device, dtype=weight.dtype)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    cond = model.encode(prompts)
    if guidance != 1.0:
        from leancompile.backbones import Conditioning

        cond = Conditioning.cat([cond, model.encode([NULL_CLASS] * n)])
    for i in range(steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        if guidance != 1.0:
            sig = torch.full((2 * n,), s, device=x.device, dtype=x.dtype)
            v_c, v_u = model.backbone(torch.cat([x, x]), sig, cond).chunk(2)
            v = v_u + guidance * (v_c - v_u)
        else:
            v = model.backbone(x, torch.full((n,), s, device=x.device, dtype=x.dtype), cond)
        x = x + (s_next - s) * v
    return x


def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All scikit-learn digits as (N, 1, 8, 8) float32 in [-1, 1] and their (N,) labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, *LATENT_SHAPE) / 8.0 - 1.0
    return x, torch.tensor(data.target, dtype=torch.long)


def to_images(x: torch.Tensor) -> np.ndarray:
    """Latents in [-1, 1] (clamped) to uint8 images (B, 8, 8)."""
    if x.dim() == 3:
        x = x[:, None]
    if x.dim() != 4 or x.shape[1] != 1:
        raise ValueError(f"x must be (B, 1, H, W), got {tuple(x.shape)}")
    x = x.detach().float().cpu().clamp(-1.0, 1.0)
    return ((x[:, 0] + 1.0) * 127.5).round().to(torch.uint8).numpy()


def save_grid(x: torch.Tensor, path: str | Path, nrow: int = 10, scale: int = 8, pad: int = 1) -> Path:
    """Write the samples as a PNG grid, upscaled with nearest neighbour so 8x8 pixels stay sharp."""
    from PIL import Image

    imgs = to_images(x)
    b, h, w = imgs.shape
    nrow = max(1, min(int(nrow), b)) if b else 1
    ncol_rows = (b + nrow - 1) // nrow
    grid = np.full((ncol_rows * (h + pad) + pad, nrow * (w + pad) + pad), 64, dtype=np.uint8)
    for i, img in enumerate(imgs):
        r, c = divmod(i, nrow)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = img
    out = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return path
