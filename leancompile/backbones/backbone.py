"""A uniform ``(x, sigma, cond) -> velocity`` call over the diffusers flow transformers."""

from __future__ import annotations

import contextlib
import inspect

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

from .conditioning import Conditioning

FAMILIES = {
    "flux": FluxTransformer2DModel,
    "sd3": SD3Transformer2DModel,
    "wan": WanTransformer3DModel,
}

# Module-name suffixes (peft ``target_modules``) of the attention projections and feed-forward
# linears. Suffixes are matched by peft as ``name == s or name.endswith("." + s)``.
_LORA_TARGETS = {
    "flux": [
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        # Single-stream blocks fuse the MLP input into ``proj_mlp`` and the attention/MLP output
        # into ``proj_out``; the suffix also adapts the model's final ``proj_out``.
        "proj_mlp", "proj_out",
    ],
    "sd3": [
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    ],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")


class Backbone(torch.nn.Module):
    """Uniform call interface over diffusers FluxTransformer2DModel, SD3Transformer2DModel,
    WanTransformer3DModel.

    ``forward(x, sigma, cond)`` takes spatial latents ``x`` of shape ``(B, *latent_shape)``, the
    noise level ``sigma`` of shape ``(B,)`` in ``[0, 1]`` (1 = pure noise) and returns the velocity
    prediction with the shape and dtype of ``x``.
    """

    def __init__(
        self,
        family: str,
        model: torch.nn.Module,
        latent_shape: tuple[int, ...],
        text_shape: tuple[int, int],
        pooled_dim: int | None,
        guidance: float = 3.5,
    ):
        super().__init__()
        _check_family(family)
        self.family = family
        self.model = model
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.text_shape = tuple(int(s) for s in text_shape)
        self.pooled_dim = None if pooled_dim is None else int(pooled_dim)
        self.guidance = float(guidance)
        want_ndim = 4 if family == "wan" else 3
        if len(self.latent_shape) != want_ndim:
            raise ValueError(
                f"latent_shape: expected {want_ndim} dims for family {family!r}, got {self.latent_shape}"
            )
        if len(self.text_shape) != 2:
            raise ValueError(f"text_shape: expected (L, D), got {self.text_shape}")
        if (family == "wan") != (self.pooled_dim is None):
            raise ValueError(
                f"pooled_dim: expected {'None' if family == 'wan' else 'an int'} for family {family!r}, "
                f"got {pooled_dim!r}"
            )

    def extra_repr(self) -> str:
        return (
            f"family={self.family!r}, latent_shape={self.latent_shape}, text_shape={self.text_shape}, "
            f"pooled_dim={self.pooled_dim}"
        )

    def block_stacks(self) -> list[tuple[str, torch.nn.ModuleList]]:
        """The model's stacks of transformer blocks, by attribute name (the units FSDP shards and profiles count)."""
        return [(name, m) for name, m in self.model.named_children() if isinstance(m, torch.nn.ModuleList) and len(m)]

    def _param(self) -> torch.Tensor:
        # Read at call time (not cached) so that functional_call / tracing substitutes are seen.
        return next(self.model.parameters())

    def _validate(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> None:
        # Shapes only: these are static under make_fx / aot_autograd, so the checks do not
        # introduce data-dependent control flow.
        if x.dim() != len(self.latent_shape) + 1 or tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"x: expected shape (B, {', '.join(map(str, self.latent_shape))}), got {tuple(x.shape)}"
            )
        batch = x.shape[0]
        if sigma.dim() != 1 or sigma.shape[0] != batch:
            raise ValueError(f"sigma: expected shape ({batch},) matching x's batch, got {tuple(sigma.shape)}")
        if cond.batch_size != batch:
            raise ValueError(f"cond: expected batch size {batch} matching x, got {cond.batch_size}")
        if tuple(cond.text.shape[1:]) != self.text_shape:
            raise ValueError(
                f"cond.text: expected shape (B, {self.text_shape[0]}, {self.text_shape[1]}), "
                f"got {tuple(cond.text.shape)}"
            )
        if self.pooled_dim is not None:
            if cond.pooled is None or tuple(cond.pooled.shape) != (batch, self.pooled_dim):
                got = None if cond.pooled is None else tuple(cond.pooled.shape)
                raise ValueError(f"cond.pooled: expected shape ({batch}, {self.pooled_dim}), got {got}")

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        self._validate(x, sigma, cond)
        # Inputs follow the weights' dtype so that e.g. float32 latents work with a bf16 model;
        # the result is cast back so callers always get x's dtype.
        dtype = self._param().dtype
        h = x.to(dtype)
        text = cond.text.to(dtype)
        pooled = None if cond.pooled is None else cond.pooled.to(dtype)
        sigma = sigma.to(dtype)
        if self.family == "flux":
            out = self._flux(h, sigma, text, pooled)
        elif self.family == "sd3":
            out = self.model(
                hidden_states=h,
                encoder_hidden_states=text,
                pooled_projections=pooled,
                timestep=sigma * 1000,
                return_dict=False,
            )[0]
        else:
            out = self.model(
                hidden_states=h, timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False
            )[0]
        return out.to(x.dtype)

    def _flux(self, x, sigma, text, pooled):
        b, c, hgt, wid = x.shape
        h2, w2 = hgt // 2, wid // 2
        # 2x2 patches -> tokens, channel-major within a patch, as the diffusers Flux pipeline packs.
        tokens = x.reshape(b, c, h2, 2, w2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h2 * w2, c * 4)
        dev = x.device
        # Position ids (0, row, col) per token and zeros for text; float32 keeps them exact at any
        # compute dtype (the rotary embedding converts them to float32 anyway).
        rows = torch.arange(h2, device=dev, dtype=torch.float32).reshape(h2, 1).expand(h2, w2)
        cols = torch.arange(w2, device=dev, dtype=torch.float32).reshape(1, w2).expand(h2, w2)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h2 * w2, 3)
        txt_ids = torch.zeros(text.shape[1], 3, device=dev, dtype=torch.float32)
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=dev, dtype=x.dtype)
        out = self.model(
            hidden_states=tokens,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=sigma,  # the Flux model scales by 1000 itself
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        out = out.reshape(b, h2, w2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, hgt, wid)

    def dummy_conditioning(
        self, batch: int, generator: torch.Generator | None = None, dtype=None
    ) -> Conditioning:
        """Standard-normal conditioning of the right shapes on the model's device.

        Drawn on the CPU (from ``generator`` if given) and then moved, so that results do not
        depend on the device.
        """
        p = self._param()
        dtype = dtype or p.dtype
        text = torch.randn((batch, *self.text_shape), generator=generator, device="cpu")
        pooled = None
        if self.pooled_dim is not None:
            pooled = torch.randn((batch, self.pooled_dim), generator=generator, device="cpu")
        return Conditioning(text, pooled).to(device=p.device, dtype=dtype)

    def lora_target_modules(self) -> list[str]:
        """Module-name suffixes for ``peft.LoraConfig(target_modules=...)``."""
        return list(_LORA_TARGETS[self.family])


@contextlib.contextmanager
def _default_dtype(dtype):
    # Constructing directly in the target dtype avoids a float32 copy of a multi-billion
    # parameter model; leftovers with explicit dtypes are cast afterwards.
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(
    family: str,
    config: dict,
    latent_shape,
    text_shape,
    pooled_dim,
    guidance: float = 3.5,
    device=None,
    dtype=None,
) -> Backbone:
    """Construct a :class:`Backbone` from a diffusers transformer config dict.

    ``config`` holds the model class's ``__init__`` arguments (diffusers ``config.json`` keys; keys
    starting with ``_`` are ignored). ``device`` defaults to the current default device.
    """
    _check_family(family)
    cls = FAMILIES[family]
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(config) - accepted)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown} for {cls.__name__}; valid: {sorted(accepted)}")
    for key in ("patch_size", "axes_dims_rope", "dual_attention_layers"):
        if isinstance(config.get(key), list):
            config[key] = tuple(config[key])
    dev_ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with dev_ctx, _default_dtype(dtype):
        model = cls(**config)
    if dtype is not None:
        # nn.Module.to, not ModelMixin.to: the latter warns about float32-only modules, a concern of
        # checkpoint loading that does not apply to a freshly built model.
        model = torch.nn.Module.to(model, dtype=dtype)
    latent_shape = tuple(latent_shape)
    in_ch = model.config.in_channels
    want = in_ch // 4 if family == "flux" else in_ch
    if latent_shape and latent_shape[0] != want:
        raise ValueError(
            f"latent_shape: expected {want} channels for in_channels={in_ch} ({family}), got {latent_shape}"
        )
    return Backbone(family, model, latent_shape, text_shape, pooled_dim, guidance=guidance)
