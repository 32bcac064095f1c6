"""One record per backbone family: everything leancompile knows about a diffusers transformer class.

A new family is one :class:`Family` here (its model class, how it is called, its LoRA targets, its latent layout
and a tiny config) plus, for planning at full size, a JSON config of a published model in ``configs/``.

The records name their diffusers class rather than import it: diffusers is imported when a model is built, not
when leancompile is (``pip install leancompile[diffusers]``).
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# peft matches a suffix as ``name == s or name.endswith("." + s)``.
_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
_JOINT = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
          "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")


@dataclass(frozen=True)
class Family:
    """A diffusers flow transformer behind the ``(x, sigma, cond) -> velocity`` call."""

    name: str
    class_name: str  # the diffusers class, imported on first use (``model_class``)
    call: Callable  # (model, x, sigma, text, pooled, guidance) -> velocity shaped like x
    lora_targets: tuple[str, ...]  # module-name suffixes for peft's ``target_modules``
    video: bool  # latents (C, F, H, W) rather than (C, H, W)
    packing: int  # latent channels are ``in_channels // packing`` (Flux packs 2x2 patches into channels)
    text_width: str  # the config key of the text conditioning's width
    tokens: Callable  # (model config, latent shape, text length) -> tokens per row the blocks attend over
    # Its blocks' arguments that every row shares (rotary embeddings), whatever their leading size (runtime.regional)
    block_shared: tuple[str, ...] = ()
    tiny: dict = field(default_factory=dict)  # a CPU-sized config with every structural feature of the real one
    tiny_geometry: dict = field(default_factory=dict)  # latent sizes and text length of the tiny model

    @property
    def model_class(self) -> type:
        """The diffusers model class (imports diffusers)."""
        try:
            diffusers = importlib.import_module("diffusers")
        except ImportError as error:
            raise ImportError(f"the {self.name} backbone needs diffusers: pip install 'leancompile[diffusers]'") \
                from error
        return getattr(diffusers, self.class_name)

    @property
    def latent_rank(self) -> int:
        return 4 if self.video else 3

    @property
    def pooled(self) -> bool:
        """Whether the model takes a pooled text embedding."""
        return not self.video


def _call_sd3(model, x, sigma, text, pooled, guidance):
    return model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=sigma * 1000,
                 return_dict=False)[0]


def _call_wan(model, x, sigma, text, pooled, guidance):
    return model(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False)[0]


def _call_flux(model, x, sigma, text, pooled, guidance):
    b, c, hgt, wid = x.shape
    h2, w2 = hgt // 2, wid // 2
    # 2x2 patches -> tokens, channel-major within a patch, as the diffusers Flux pipeline packs.
    tokens = x.reshape(b, c, h2, 2, w2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h2 * w2, c * 4)
    dev = x.device
    # Position ids (0, row, col) per token and zeros for text; float32 keeps them exact at any compute dtype (the
    # rotary embedding converts them to float32 anyway).
    rows = torch.arange(h2, device=dev, dtype=torch.float32).reshape(h2, 1).expand(h2, w2)
    cols = torch.arange(w2, device=dev, dtype=torch.float32).reshape(1, w2).expand(h2, w2)
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h2 * w2, 3)
    txt_ids = torch.zeros(text.shape[1], 3, device=dev, dtype=torch.float32)
    scale = torch.full((b,), guidance, device=dev, dtype=x.dtype) if model.config.guidance_embeds else None
    out = model(hidden_states=tokens, encoder_hidden_states=text, pooled_projections=pooled,
                timestep=sigma,  # the Flux model scales by 1000 itself
                img_ids=img_ids, txt_ids=txt_ids, guidance=scale, return_dict=False)[0]
    out = out.reshape(b, h2, w2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return out.reshape(b, c, hgt, wid)


def _image_tokens(config, latent, text_len) -> int:
    return latent[1] * latent[2] // config.patch_size ** 2 + text_len


def _video_tokens(config, latent, text_len) -> int:
    frames, height, width = config.patch_size
    return latent[1] // frames * latent[2] * latent[3] // (height * width)


FLUX = Family(
    "flux", "FluxTransformer2DModel", _call_flux,
    # Single-stream blocks fuse the MLP input into ``proj_mlp`` and the attention/MLP output into ``proj_out``; the
    # suffix also adapts the model's final ``proj_out``.
    _ATTENTION + _JOINT + ("proj_mlp", "proj_out"),
    video=False, packing=4, text_width="joint_attention_dim",
    tokens=lambda config, latent, text_len: latent[1] * latent[2] // 4 + text_len,  # 2x2 packed
    block_shared=("image_rotary_emb",),
    tiny=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
              axes_dims_rope=(4, 6, 6)),
    tiny_geometry=dict(height=8, width=8, text_len=8),
)
SD3 = Family(
    "sd3", "SD3Transformer2DModel", _call_sd3, _ATTENTION + _JOINT,
    video=False, packing=1, text_width="joint_attention_dim", tokens=_image_tokens,
    tiny=dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16,
              out_channels=4, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"),
    tiny_geometry=dict(height=8, width=8, text_len=8),
)
WAN = Family(
    "wan", "WanTransformer3DModel", _call_wan, _ATTENTION + ("ffn.net.0.proj", "ffn.net.2"),
    video=True, packing=1, text_width="text_dim", tokens=_video_tokens, block_shared=("rotary_emb",),
    tiny=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
              text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6),
    tiny_geometry=dict(frames=2, height=8, width=8, text_len=8),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (FLUX, SD3, WAN)}


def family(name: str) -> Family:
    """The record of family ``name``; a clear error naming the valid ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_of(module: torch.nn.Module) -> Family | None:
    """The family of the first of ``module``'s submodules that is a model of a known family, or None.

    Without importing diffusers: while it is not imported, no module can be one of its models."""
    if "diffusers" not in sys.modules:
        return None
    return next((f for f in FAMILIES.values() for m in module.modules() if isinstance(m, f.model_class)), None)
