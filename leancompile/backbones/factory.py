"""Tiny CPU-sized backbones for tests and the published configs of the real models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .backbone import Backbone, build
from .families import FAMILIES
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
    """A real model's record: ``source``, ``family``, ``class``, ``config``, ``geometry``. ``name`` is a shipped
    model (``REAL_MODELS``) or the path of a diffusers ``config.json`` (or of the folder holding it)."""
    if name in REAL_MODELS:
        return json.loads((_CONFIG_DIR / f"{name}.json").read_text())
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        return diffusers_config(path)
    raise ValueError(f"name: expected one of {REAL_MODELS} or the path of a diffusers config.json, got {name!r}")


def diffusers_config(path: str | Path) -> dict:
    """The record of a model described by a diffusers ``config.json`` (the one ``save_pretrained`` writes beside
    the weights; ``_class_name`` names the family's class). Its geometry (VAE factors, text length and encoders)
    is the shipped model's of the same family, its latent channels and text width read from the config."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = json.loads(path.read_text())
    class_name = raw.get("_class_name")
    spec = next((f for f in FAMILIES.values() if f.class_name == class_name), None)
    if spec is None:
        known = ", ".join(f.class_name for f in FAMILIES.values())
        raise ValueError(f"{path}: _class_name {class_name!r} is not a supported model class; supported: {known}")
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    shipped = next(load_config(m) for m in REAL_MODELS if load_config(m)["family"] == spec.name)
    missing = [k for k in ("in_channels", spec.text_width) if k not in config]
    if missing:
        raise ValueError(f"{path}: the config lacks {missing}")
    geometry = dict(shipped["geometry"], latent_channels=config["in_channels"] // spec.packing,
                    text_dim=config[spec.text_width])
    if spec.pooled:
        geometry["pooled_dim"] = config.get("pooled_projection_dim", geometry["pooled_dim"])
    return {"source": str(path), "family": spec.name, "class": class_name, "config": config, "geometry": geometry}


def real(
    name: str,
    resolution: int | tuple[int, int] = 1024,
    frames: int = 81,
    device="meta",
    dtype=torch.bfloat16,
    text_len: int | None = None,
) -> Backbone:
    """A real model's architecture (randomly initialised; on the meta device by default).

    ``name`` is a shipped model or a diffusers ``config.json`` (:func:`load_config`). ``resolution`` is in
    pixels, ``(height, width)`` or a square side; ``frames`` is the video length in frames (wan only);
    ``text_len`` the text conditioning's tokens (default: the record's). Weights are not loaded.
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
        (text_len or geo["text_len"], geo["text_dim"]),
        geo["pooled_dim"],
        device=device,
        dtype=dtype,
    )
