"""What the benchmark runs: backbone sizes and the two trainers' configurations."""
from __future__ import annotations

from dataclasses import dataclass, field

from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig

FAMILIES = ("flux", "sd3", "wan")
TRAINERS = ("flowgrpo", "dancegrpo")
PROMPTS = (1, 2)
GROUP_SIZE = 2
NUM_STEPS = 6

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


@dataclass(frozen=True)
class Case:
    """One row of the results: a backbone family at some size, trained by one trainer."""

    backbone: str
    trainer: str
    config: GRPOConfig
    sizes: dict = field(default_factory=dict)  # overrides of ``leancompile.backbones.tiny``
    prompts: tuple[int, ...] = PROMPTS
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.backbone}/{self.trainer}"


def trainer_config(trainer: str, num_samples: int, seed: int = 0) -> GRPOConfig:
    """A trainer's config with exactly one optimizer step per rollout: Retain reuses the rollout until the first
    optimizer step, so this is the configuration where it removes every re-forward."""
    if trainer == "flowgrpo":
        # timestep_fraction 0.99 trains the first int(0.99 * S) = S - 1 steps of every sample.
        return FlowGRPOConfig(num_steps=NUM_STEPS, timestep_fraction=0.99, guidance_scale=1.0, group_size=GROUP_SIZE,
                              train_batch_size=num_samples // 2, gradient_accumulation_steps=2, seed=seed)
    if trainer == "dancegrpo":
        # DanceGRPO's own defaults otherwise: random steps per sample, micro-batch 1 in the rollout and the update,
        # and gradient checkpointing, which the native update pays for and the optimized schedules do not.
        return DanceGRPOConfig(num_steps=NUM_STEPS, group_size=GROUP_SIZE, train_batch_size=1, sample_batch_size=1,
                               gradient_accumulation_steps=num_samples, seed=seed)
    raise ValueError(f"trainer must be one of {TRAINERS}; got {trainer!r}")


def backbone_sizes(family: str, full: bool = False) -> dict:
    sizes = dict(_QUICK_SIZES[family])
    if full:
        sizes.update(height=2 * sizes["height"], width=2 * sizes["width"])
    return sizes


def cases(full: bool = False, families=FAMILIES, trainers=TRAINERS, smallest: bool = False) -> list[Case]:
    """The benchmark's rows; ``smallest`` keeps the tiny defaults (for tests of the machinery)."""
    num_samples = len(PROMPTS) * GROUP_SIZE
    return [Case(family, trainer, trainer_config(trainer, num_samples),
                 {} if smallest else backbone_sizes(family, full))
            for family in families for trainer in trainers]
