"""Scenarios for the planner: a live trainer's GRPO step, or a real-size model described on the command line."""
from __future__ import annotations

import functools
import math

import torch

from ..backbones import factory
from ..trainers import TRAINERS
from .planner import Scenario
from .sharding import sharding as layout
from .profile import profile_call


def reweight_buffers(config, advantage_free: bool, samples: int) -> int:
    """Whole-gradient buffers Reweight holds at most: one per backbone row (two per sample under CFG) and trained
    step, per provisional cotangent (the policy term, and the advantage-free terms where the loss has them)."""
    rows = 2 if config.use_cfg else 1
    return samples * rows * config.num_trained_steps * (2 if advantage_free else 1)


def trainer_scenario(trainer, samples_per_step: int, **fields) -> Scenario:
    """The scenario of ``trainer``'s GRPO step over ``samples_per_step`` samples; ``fields`` holds the Scenario
    fields the passes and the data-parallel engine decide (Reweight's refusal, advantage-free terms, per-sample
    backwards and buffers; world size and sharding)."""
    cfg, backbone = trainer.config, trainer.backbone
    autocast = torch.bfloat16 if cfg.mixed_precision == "bf16" else None
    trainable = trainer.trainable
    ids = {id(p) for p in trainable}
    frozen = [p for p in backbone.parameters() if id(p) not in ids]
    profile = _cached_profile(backbone, autocast, trainer.device.type)
    dtype = next(backbone.parameters()).dtype
    return Scenario(cfg, samples_per_step, profile,
                    total_params=sum(p.numel() for p in backbone.parameters()),
                    trainable_params=sum(p.numel() for p in trainable),
                    weight_bytes=frozen[0].element_size() if frozen else dtype.itemsize,
                    trainable_bytes=trainable[0].element_size() if trainable else dtype.itemsize,
                    latent_bytes=math.prod(backbone.latent_shape) * dtype.itemsize,
                    compute_dtype=autocast or dtype, **fields)


_PROFILES: dict = {}


def _cached_profile(backbone, autocast, device_type):
    """Profiles by structure: two trainers of the same architecture, geometry and trainable set share one."""
    key = (repr(backbone), backbone.latent_shape, backbone.text_shape,
           tuple((n, p.dtype, p.requires_grad) for n, p in backbone.named_parameters()), autocast, device_type)
    if key not in _PROFILES:
        _PROFILES[key] = profile_call(backbone, autocast, device_type)
    return _PROFILES[key]


def model_scenario(name: str, *, trainer: str = "dancegrpo", resolution: int = 1024, frames: int = 81,
                   steps: int = 16, timestep_fraction: float = 0.6, lora_rank: int | None = 64,
                   micro_batch: int = 1, samples: int = 8, guidance_scale: float = 1.0, beta: float = 0.0,
                   ema: bool = False, gradient_checkpointing: bool | None = None, world_size: int = 1,
                   sharding: str = "fsdp", text_len: int | None = None) -> Scenario:
    """A real model (architecture only, on the meta device) trained in bf16 with float32 trainable weights,
    gradients and AdamW moments (mixed precision as FlowGRPO and DanceGRPO run it), ``samples`` per rank per
    GRPO step in micro-batches of ``micro_batch`` and one optimizer step per rollout; the group spans the ranks
    (every rank samples the same prompt)."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {sorted(TRAINERS)}; got {trainer!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if samples < 1 or samples * world_size < 2 or samples % micro_batch:
        raise ValueError(f"samples must be a multiple of micro_batch={micro_batch} and a group of at least 2 over "
                         f"all ranks; got {samples} per rank on {world_size}")
    layout(sharding)  # a clear error for an unknown name, before the model is built
    options = dict(num_steps=steps, timestep_fraction=timestep_fraction, guidance_scale=guidance_scale, beta=beta,
                   group_size=samples * world_size, train_batch_size=micro_batch, sample_batch_size=micro_batch,
                   gradient_accumulation_steps=samples // micro_batch, lora_rank=lora_rank, ema=ema)
    if gradient_checkpointing is not None:
        options["gradient_checkpointing"] = gradient_checkpointing
    config = TRAINERS[trainer].config_class(**options)
    backbone = _real_backbone(name, resolution, frames, lora_rank, text_len)
    profile = _cached_profile(backbone, None, "cpu")
    trainable = [p for p in backbone.parameters() if p.requires_grad]
    advantage_free = beta > 0
    buffers = reweight_buffers(config, advantage_free, samples)
    return Scenario(config, samples, profile,
                    total_params=sum(p.numel() for p in backbone.parameters()),
                    trainable_params=sum(p.numel() for p in trainable),
                    weight_bytes=2, trainable_bytes=4,
                    latent_bytes=math.prod(backbone.latent_shape) * 4,
                    compute_dtype=torch.bfloat16, advantage_free=advantage_free,
                    buffers=buffers, world_size=world_size, sharding=sharding)


@functools.lru_cache(maxsize=8)
def _real_backbone(name: str, resolution: int, frames: int, lora_rank: int | None, text_len: int | None = None):
    backbone = factory.real(name, resolution=resolution, frames=frames, device="meta", dtype=torch.bfloat16,
                            text_len=text_len)
    if lora_rank is None:
        return backbone.requires_grad_(True)
    from peft import LoraConfig

    backbone.requires_grad_(False)
    backbone.model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank,
                                          target_modules=backbone.lora_target_modules()))
    return backbone
