"""A uniform ``(x, sigma, cond) -> velocity`` call over the diffusers flow transformers."""

from __future__ import annotations

import contextlib
import inspect

import torch

from .conditioning import Conditioning
from .families import family as family_spec


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
        self.spec = family_spec(family)  # the family's record (leancompile.backbones.families)
        self.family = family
        self.model = model
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.text_shape = tuple(int(s) for s in text_shape)
        self.pooled_dim = None if pooled_dim is None else int(pooled_dim)
        self.guidance = float(guidance)
        if len(self.latent_shape) != self.spec.latent_rank:
            raise ValueError(
                f"latent_shape: expected {self.spec.latent_rank} dims for family {family!r}, got {self.latent_shape}"
            )
        if len(self.text_shape) != 2:
            raise ValueError(f"text_shape: expected (L, D), got {self.text_shape}")
        if self.spec.pooled == (self.pooled_dim is None):
            raise ValueError(
                f"pooled_dim: expected {'an int' if self.spec.pooled else 'None'} for family {family!r}, "
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
        out = self.spec.call(self.model, h, sigma, text, pooled, self.guidance)
        return out.to(x.dtype)

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
        return list(self.spec.lora_targets)


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
    spec = family_spec(family)
    cls = spec.model_class
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
    want = in_ch // spec.packing
    if latent_shape and latent_shape[0] != want:
        raise ValueError(
            f"latent_shape: expected {want} channels for in_channels={in_ch} ({family}), got {latent_shape}"
        )
    return Backbone(family, model, latent_shape, text_shape, pooled_dim, guidance=guidance)
