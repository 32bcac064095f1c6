"""Tiny CPU-sized backbones for tests and the published configs of the real models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .backbone import Backbone, build
from .families import family as family_spec

_CONFIG_DIR = Path(__file__).parent / "configs"

REAL_MODELS = ("flux.1-dev", "sd3.5-medium", "wan2.1-1.3b", "wan2.1-14b")

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
    spec = family_spec(family)
    config = dict(spec.tiny)
    geometry = dict(spec.tiny_geometry)
    for key, value in overrides.items():
        if key in geometry:
            geometry[key] = value
        elif key in ("height", "width", "frames", "text_len"):
            raise ValueError(f"{key}: not a geometry key of family {family!r}; valid: {sorted(geometry)}")
        else:
            config[key] = value  # unknown keys are rejected by build()
    channels = config["in_channels"] // spec.packing
    text = (geometry["text_len"], config[spec.text_width])
    pooled = config["pooled_projection_dim"] if spec.pooled else None
    spatial = (geometry["height"], geometry["width"])
    latent = (channels, geometry["frames"], *spatial) if spec.video else (channels, *spatial)
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
    if family_spec(family).video:
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
