"""Configurations of the native trainers. Field names follow FlowGRPO's and DanceGRPO's own configs.

Each config validates itself on construction: a bad value raises ``ValueError`` naming the field, the valid range
and the value given.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


def _require(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} must be {rule}; got {value!r}")


@dataclass(frozen=True)
class GRPOConfig:
    """Fields shared by both trainers. See the README for each field's meaning."""

    num_steps: int = 10
    timestep_fraction: float = 0.99
    guidance_scale: float = 1.0  # 1.0 disables classifier-free guidance
    train_cfg: bool = True  # apply CFG in the update too (when guidance_scale > 1)
    cfg_detach_uncond: bool = False  # the update's unconditional branch carries no gradient
    shift: float = 3.0
    group_size: int = 4
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0  # KL weight to the reference model; 0 disables the reference forward
    global_std: bool = False
    trained_steps: str = "first"  # "first" k in order | "random" k per sample | "window" (the SDE window)
    sde_window_size: int = 0  # >0: SDE only inside a window of this many steps, ODE elsewhere
    sde_window_range: tuple[int, int] | None = None  # where the window may start and end; default all steps
    sample_batch_size: int | None = None  # rollout micro-batch; None = all samples at once
    train_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    num_inner_epochs: int = 1
    lora_rank: int | None = 4  # None: full fine-tuning
    lora_alpha: float | None = None  # None: equal to lora_rank
    learning_rate: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    drop_zero_advantages: bool = True  # FlowGRPO leaves samples with advantage 0 out of the update
    ema: bool = False
    ema_decay: float = 0.9
    gradient_checkpointing: bool = False
    dtype: str = "float32"  # "float32" | "float64"
    mixed_precision: str = "no"  # "no" | "bf16" (autocast around the backbone)
    seed: int = 0
    parallel: str = "none"  # "none" | "ddp" | "fsdp" (FSDP2): data parallel over torch.distributed's ranks
    same_prompt_groups: bool = False  # every rank samples every prompt, group_size / world_size samples each

    # Per-trainer constants, overridden by the subclasses.
    algorithm = "grpo"
    adv_eps = 1e-4
    adv_unbiased = False
    step_kind = "sde"

    def __post_init__(self) -> None:
        _require(isinstance(self.num_steps, int) and self.num_steps >= 1, "num_steps", "an integer >= 1", self.num_steps)
        _require(0 < self.timestep_fraction <= 1, "timestep_fraction", "in (0, 1]", self.timestep_fraction)
        _require(self.guidance_scale >= 1, "guidance_scale", ">= 1 (1 disables guidance)", self.guidance_scale)
        _require(self.shift > 0, "shift", "> 0", self.shift)
        _require(isinstance(self.group_size, int) and self.group_size >= 2, "group_size",
                 "an integer >= 2 (advantages compare samples within a group)", self.group_size)
        _require(self.clip_range > 0, "clip_range", "> 0", self.clip_range)
        _require(self.adv_clip_max > 0, "adv_clip_max", "> 0", self.adv_clip_max)
        _require(self.beta >= 0, "beta", ">= 0", self.beta)
        _require(self.trained_steps in ("first", "random", "window"), "trained_steps",
                 "one of 'first', 'random', 'window'", self.trained_steps)
        _require(0 <= self.sde_window_size <= self.num_steps, "sde_window_size", f"in [0, num_steps={self.num_steps}]",
                 self.sde_window_size)
        _require(self.trained_steps != "window" or self.sde_window_size > 0, "sde_window_size",
                 "> 0 when trained_steps='window'", self.sde_window_size)
        # Outside the window the steps are deterministic and have no log-probability to train.
        _require(self.sde_window_size == 0 or self.trained_steps == "window", "trained_steps",
                 "'window' when sde_window_size > 0", self.trained_steps)
        lo, hi = self.window_range
        _require(0 <= lo and lo + self.sde_window_size <= hi <= self.num_steps, "sde_window_range",
                 f"(lo, hi) with 0 <= lo, lo + sde_window_size <= hi <= num_steps={self.num_steps}",
                 self.sde_window_range)
        _require(self.num_trained_steps >= 1, "timestep_fraction",
                 f"large enough to train at least one of {self.num_steps} steps", self.timestep_fraction)
        for name in ("train_batch_size", "gradient_accumulation_steps", "num_inner_epochs"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, "an integer >= 1", value)
        _require(self.sample_batch_size is None or (isinstance(self.sample_batch_size, int) and self.sample_batch_size >= 1),
                 "sample_batch_size", "None or an integer >= 1", self.sample_batch_size)
        _require(self.lora_rank is None or (isinstance(self.lora_rank, int) and self.lora_rank >= 1), "lora_rank",
                 "None (full fine-tuning) or an integer >= 1", self.lora_rank)
        _require(self.learning_rate > 0, "learning_rate", "> 0", self.learning_rate)
        _require(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm", "None or > 0", self.max_grad_norm)
        _require(0 <= self.ema_decay < 1, "ema_decay", "in [0, 1)", self.ema_decay)
        _require(self.dtype in ("float32", "float64"), "dtype", "'float32' or 'float64'", self.dtype)
        _require(self.mixed_precision in ("no", "bf16"), "mixed_precision", "'no' or 'bf16'", self.mixed_precision)
        _require(not (self.dtype == "float64" and self.mixed_precision == "bf16"), "mixed_precision",
                 "'no' when dtype='float64'", self.mixed_precision)
        _require(self.parallel in ("none", "ddp", "fsdp"), "parallel", "one of 'none', 'ddp', 'fsdp'", self.parallel)
        _require(not self.same_prompt_groups or self.parallel != "none", "same_prompt_groups",
                 "False when parallel='none' (the layout splits groups across ranks)", self.same_prompt_groups)
        # Every rank must run the same number of optimizer steps (each one synchronises the gradients).
        _require(self.parallel == "none" or not self.drop_zero_advantages, "drop_zero_advantages",
                 "False when parallel != 'none' (ranks would train different numbers of micro-batches)",
                 self.drop_zero_advantages)

    @property
    def noise(self) -> float:
        """The step's noise level (FlowGRPO's noise_level, DanceGRPO's eta)."""
        raise NotImplementedError

    @property
    def window_range(self) -> tuple[int, int]:
        return tuple(self.sde_window_range) if self.sde_window_range is not None else (0, self.num_steps)

    @property
    def counted_steps(self) -> int:
        """The denoising steps ``timestep_fraction`` is a fraction of (FlowGRPO: all of them); the planner spreads
        a ``"random"`` draw's trained steps over these."""
        return self.num_steps

    @property
    def num_trained_steps(self) -> int:
        """Trained steps per sample: the SDE window, or ``int(num_steps * timestep_fraction)``."""
        if self.trained_steps == "window":
            return self.sde_window_size
        return int(self.num_steps * self.timestep_fraction)

    @property
    def use_cfg(self) -> bool:
        return self.guidance_scale > 1

    def to_dict(self) -> dict:
        return {"algorithm": self.algorithm, **asdict(self)}


@dataclass(frozen=True)
class FlowGRPOConfig(GRPOConfig):
    """FlowGRPO: SDE (or CPS) steps, population-std advantages with eps 1e-4, first-k trained steps."""

    noise_level: float = 0.7
    sde_type: str = "sde"  # "sde" | "cps"

    algorithm = "flowgrpo"
    adv_eps = 1e-4
    adv_unbiased = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.noise_level > 0, "noise_level", "> 0", self.noise_level)
        _require(self.sde_type in ("sde", "cps"), "sde_type", "'sde' or 'cps'", self.sde_type)
        _require(self.sde_type != "cps" or self.noise_level < 1, "noise_level", "< 1 for sde_type='cps'", self.noise_level)

    @property
    def noise(self) -> float:
        return self.noise_level

    @property
    def step_kind(self) -> str:  # type: ignore[override]
        return self.sde_type


@dataclass(frozen=True)
class DanceGRPOConfig(GRPOConfig):
    """DanceGRPO: its own SDE step, unbiased-std advantages with eps 1e-8, a random subset of steps per sample,
    micro-batch 1 and activation checkpointing by default, quantised timesteps."""

    num_steps: int = 16
    timestep_fraction: float = 0.6
    trained_steps: str = "random"
    train_batch_size: int = 1
    sample_batch_size: int | None = 1
    gradient_checkpointing: bool = True
    drop_zero_advantages: bool = False
    eta: float = 0.3

    algorithm = "dancegrpo"
    adv_eps = 1e-8
    adv_unbiased = True
    step_kind = "dance"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.eta > 0, "eta", "> 0", self.eta)

    @property
    def noise(self) -> float:
        return self.eta

    @property
    def counted_steps(self) -> int:
        """DanceGRPO counts the steps that end above sigma 0."""
        return max(self.num_steps - 1, 1)

    @property
    def num_trained_steps(self) -> int:
        if self.trained_steps == "window":
            return self.sde_window_size
        return max(int(self.counted_steps * self.timestep_fraction), 1 if self.num_steps == 1 else 0)
