"""Tiny CPU-sized backbones for tests and the published configs of the real models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .backbone import FAMILIES, Backbone, build

_CONFIG_DIR = Path(__file__).parent / "configs"

REAL_MODELS = ("flux.1-dev", "sd3.5-medium", "wan2.1-1.3b", "wan2.1-14b")

# Tiny configs: every structural feature of the real model (guidance embedding, dual attention,
# qk-norm, cross-attention norm) at a width that runs in milliseconds on a CPU.
_TINY = {
    "flux": dict(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
    "sd3": dict(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ),
    "wan": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ),
}
# Latent / text geometry of the tiny models; frames/height/width are latent sizes.
_TINY_GEOMETRY = {
    "flux": dict(height=8, width=8, text_len=8),
    "sd3": dict(height=8, width=8, text_len=8),
    "wan": dict(frames=2, height=8, width=8, text_len=8),
}


def _reinit_zero_params(model: torch.nn.Module, std: float = 0.02) -> None:
    # diffusers zero-initialises some layers (output projections, norm biases); with exact zeros the
    # output ignores its inputs and upstream layers get no gradient, which hides bugs in tests.
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not torch.any(p != 0):
                p.normal_(0.0, std)


def tiny(family: str, seed: int = 0, dtype=torch.float32, **overrides) -> Backbone:
    """A small (well under 1M parameters) randomly initialised backbone of ``family``.

    ``overrides`` replace tiny config keys or the geometry keys ``height``, ``width``, ``frames``
    (wan) and ``text_len`` (latent sizes, not pixels). Weights depend only on ``seed`` and the
    config: they are drawn in float32 under a forked RNG and then cast to ``dtype``.
    """
    if family not in _TINY:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    config = dict(_TINY[family])
    geometry = dict(_TINY_GEOMETRY[family])
    for key, value in overrides.items():
        if key in geometry:
            geometry[key] = value
        elif key in ("height", "width", "frames", "text_len"):
            raise ValueError(f"{key}: not a geometry key of family {family!r}; valid: {sorted(geometry)}")
        else:
            config[key] = value  # unknown keys are rejected by build()
    if family == "flux":
        channels = config["in_channels"] // 4
        text = (geometry["text_len"], config["joint_attention_dim"])
        pooled = config["pooled_projection_dim"]
    elif family == "sd3":
        channels = config["in_channels"]
        text = (geometry["text_len"], config["joint_attention_dim"])
        pooled = config["pooled_projection_dim"]
    else:
        channels = config["in_channels"]
        text = (geometry["text_len"], config["text_dim"])
        pooled = None
    spatial = (geometry["height"], geometry["width"])
    latent = (channels, geometry["frames"], *spatial) if family == "wan" else (channels, *spatial)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = build(family, config, latent, text, pooled, device="cpu", dtype=torch.float32)
        _reinit_zero_params(backbone.model)
    return backbone.to(dtype)


def load_config(name: str) -> dict:
    """The JSON shipped for a real model: ``source``, ``family``, ``class``, ``config``, ``geometry``."""
    if name not in REAL_MODELS:
        raise ValueError(f"name: expected one of {REAL_MODELS}, got {name!r}")
    return json.loads((_CONFIG_DIR / f"{name}.json").read_text())


def real(
    name: str,
    resolution: int | tuple[int, int] = 1024,
    frames: int = 81,
    device="meta",
    dtype=torch.bfloat16,
) -> Backbone:
    """A real model's architecture (randomly initialised; on the meta device by default).

    ``resolution`` is in pixels, ``(height, width)`` or a square side; ``frames`` is the video
    length in frames (wan only). Weights are not loaded.
    """
    spec = load_config(name)
    family, config, geo = spec["family"], spec["config"], spec["geometry"]
    height, width = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    # Flux packs 2x2 latent patches and SD3/Wan patchify 2x2, so pixels must divide by 16.
    multiple = geo["vae_spatial_factor"] * 2
    if height % multiple or width % multiple or height <= 0 or width <= 0:
        raise ValueError(f"resolution: expected positive multiples of {multiple}, got {(height, width)}")
    spatial = (height // geo["vae_spatial_factor"], width // geo["vae_spatial_factor"])
    if family == "wan":
        if frames < 1:
            raise ValueError(f"frames: expected >= 1, got {frames}")
        latent_frames = (frames - 1) // geo["vae_temporal_factor"] + 1
        latent = (geo["latent_channels"], latent_frames, *spatial)
    else:
        latent = (geo["latent_channels"], *spatial)
    return build(
        family,
        config,
        latent,
        (geo["text_len"], geo["text_dim"]),
        geo["pooled_dim"],
        device=device,
        dtype=dtype,
    )
