"""What the benchmark runs: backbone sizes and the two trainers' configurations."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig

FAMILIES = ("flux", "sd3", "wan")
# The originals' schedules: FlowGRPO on SD3.5 (10 steps, the first 9 trained, CFG, KL), FlowGRPO-Fast / MixGRPO
# (SDE and training only inside a window of 3 steps), DanceGRPO (16 steps, 9 random per sample, micro-batch 1,
# activation checkpointing in native).
TRAINERS = ("flowgrpo", "fast", "dancegrpo")
TUNINGS = ("lora", "full")
# Quick mode: every backbone once and every schedule once, two of them the paper's settings (SD3.5 FlowGRPO, Wan
# DanceGRPO). The grid (every backbone under every schedule) is ``--grid``.
QUICK_PAIRS = (("flux", "fast"), ("sd3", "flowgrpo"), ("wan", "dancegrpo"))
PROMPTS = (1, 2)
GROUP_SIZE = 2

# Wider than the test defaults (hidden size 256, 64 image tokens) so that each aten op does enough work for the
# per-op Python cost of eager and compiled execution alike to stay small; at hidden size 32 that cost is most of
# a backbone call and the timings compare interpreters, not programs. A native step takes roughly 0.4-1 s on one
# CPU thread; Flux keeps one block of each kind to stay in that range. ``--full`` doubles the latent side.
_QUICK_SIZES = {
    "flux": dict(attention_head_dim=64, num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 28, 28),
                 num_layers=1, num_single_layers=1, height=16, width=16, text_len=16),
    "sd3": dict(attention_head_dim=64, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=256,
                height=16, width=16, text_len=16, sample_size=16, pos_embed_max_size=32),
    "wan": dict(attention_head_dim=64, num_attention_heads=4, text_dim=64, ffn_dim=1024, height=16, width=16,
                text_len=16),
}

# On a GPU, at the quick sizes every kernel is launch-bound; these changes to them are wide enough (hidden size 1024,
# 1024 image tokens; Wan 2 frames of them) for the matrix products to be most of a step.
_GPU_WIDER = dict(num_attention_heads=16, height=64, width=64, text_len=64)
_GPU_SIZES = {
    "flux": {**_QUICK_SIZES["flux"], **_GPU_WIDER, "joint_attention_dim": 256, "num_single_layers": 2},
    "sd3": {**_QUICK_SIZES["sd3"], **_GPU_WIDER, "joint_attention_dim": 256, "caption_projection_dim": 1024,
            "sample_size": 64, "pos_embed_max_size": 64},
    "wan": {**_QUICK_SIZES["wan"], **_GPU_WIDER, "text_dim": 256, "ffn_dim": 4096},
}


@dataclass(frozen=True)
class Case:
    """One row group of the results: a backbone family at some size, trained by one schedule of the originals."""

    backbone: str
    trainer: str  # "flowgrpo" | "fast" | "dancegrpo"
    config: GRPOConfig
    sizes: dict = field(default_factory=dict)  # overrides of ``leancompile.backbones.tiny``
    prompts: tuple[int, ...] = PROMPTS
    seed: int = 0
    device: str = "cpu"

    @property
    def tuning(self) -> str:
        return "lora" if self.config.lora_rank is not None else "full"

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    @property
    def name(self) -> str:
        return f"{self.backbone}/{self.trainer}/{self.tuning}"


def trainer_config(trainer: str, num_samples: int, tuning: str = "lora", seed: int = 0) -> GRPOConfig:
    """A schedule's config with exactly one optimizer step per rollout: reuse serves the micro-steps before the
    first optimizer step, so this is the configuration where it removes every re-forward."""
    lora = {"lora_rank": 4 if tuning == "lora" else None}
    if trainer == "flowgrpo":
        return FlowGRPOConfig(num_steps=10, timestep_fraction=0.99, guidance_scale=4.5, beta=0.04,
                              group_size=GROUP_SIZE, train_batch_size=num_samples // 2, gradient_accumulation_steps=2,
                              seed=seed, **lora)
    if trainer == "fast":
        return FlowGRPOConfig(num_steps=10, trained_steps="window", sde_window_size=3, sde_window_range=(0, 6),
                              group_size=GROUP_SIZE, train_batch_size=num_samples // 2, gradient_accumulation_steps=2,
                              seed=seed, **lora)
    if trainer == "dancegrpo":
        return DanceGRPOConfig(num_steps=16, group_size=GROUP_SIZE, train_batch_size=1, sample_batch_size=1,
                               gradient_accumulation_steps=num_samples, seed=seed, **lora)
    raise ValueError(f"trainer must be one of {TRAINERS}; got {trainer!r}")


def backbone_sizes(family: str, full: bool = False, device: str = "cpu") -> dict:
    sizes = dict((_GPU_SIZES if device == "cuda" else _QUICK_SIZES)[family])
    if full:
        sizes.update(height=2 * sizes["height"], width=2 * sizes["width"])
    return sizes


def cases(full: bool = False, families=FAMILIES, trainers=TRAINERS, tunings=TUNINGS, smallest: bool = False,
          device: str = "cpu", precision: str = "float32", pairs=None) -> list[Case]:
    """The benchmark's row groups: each family under each trainer, or only the ``(family, trainer)`` ``pairs``
    among them; ``smallest`` keeps the tiny defaults (for tests of the machinery); ``precision="bf16"`` runs the
    backbone under bf16 autocast over float32 weights (as on a GPU)."""
    num_samples = len(PROMPTS) * GROUP_SIZE
    numerics = {"mixed_precision": "bf16"} if precision == "bf16" else {}
    return [Case(family, trainer, replace(trainer_config(trainer, num_samples, tuning), **numerics),
                 {} if smallest else backbone_sizes(family, full, device), device=device)
            for family in families for trainer in trainers if pairs is None or (family, trainer) in pairs
            for tuning in tunings]


# The test suite's size (the tiny defaults): FlowGRPO with 8 denoising steps, the first 6 trained, groups of 4. The
# per-row program's fixed costs decide here, so auto must measure no slower than native (benchmarks.test_size).
TEST_SIZE_CONFIG = FlowGRPOConfig(num_steps=8, timestep_fraction=0.75, group_size=4)


def test_size_cases(families=("wan", "sd3")) -> list[Case]:
    return [Case(family, "flowgrpo", TEST_SIZE_CONFIG) for family in families]
