"""The native GRPO trainer for flow transformers, shared by FlowGRPO and DanceGRPO.

One ``step(prompts)`` is: rollout (no grad, S denoising steps per sample with log-probs), rewards and
group-normalised advantages, then the update: for each inner epoch, shuffled micro-batches, and for each
micro-batch one micro-step per trained step (re-forward of the backbone with grad, clipped PPO loss, optional KL
to the reference), with an optimizer step every ``gradient_accumulation_steps`` micro-batches.

The trainer protocol that :func:`leancompile.optimize` relies on is spelled out in :mod:`leancompile.protocol`:
the two backbone call sites are :meth:`GRPOTrainer.rollout_velocity` and :meth:`GRPOTrainer.train_velocity`.

All randomness comes from three generators seeded by ``config.seed`` and consumed in a fixed order:
``noise`` (initial latents, then SDE noise, chunk by chunk and step by step), ``steps`` (the SDE window at the
start of the rollout, then each inner epoch's trained-step schedule) and ``shuffle`` (each inner epoch's sample
order). Rewards cannot influence the first two, so an optimized trainer can draw them ahead of time.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import time
from typing import Callable, Sequence

import torch

from ..backbones import Backbone, Conditioning
from ..protocol import MicroStep, Rollout
from .advantages import check_rewards, group_advantages
from .checkpoint import load_checkpoint, save_checkpoint
from .config import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig
from .parallel import gradient_sync
from .sampling import STEP_FUNCTIONS, ode_step, quantized_timestep, shifted_sigmas

RewardFn = Callable[[torch.Tensor, Sequence], torch.Tensor]
EncodeFn = Callable[[Sequence], Conditioning]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
GENERATORS = ("noise", "steps", "shuffle")


def generator_seeds(seed: int, rank: int = 0) -> dict[str, int]:
    """The seed of each generator on ``rank``: every rank draws its own noise, schedules and shuffles."""
    return {name: seed + offset + len(GENERATORS) * rank for offset, name in enumerate(GENERATORS)}


class GRPOTrainer:
    """Native GRPO for a flow transformer. Subclasses fix the step function and timestep convention."""

    config_class = GRPOConfig

    def __init__(
        self,
        config: GRPOConfig,
        backbone: Backbone,
        reward_fn: RewardFn,
        encode: EncodeFn,
        uncond: Conditioning | None = None,
    ):
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}; got {type(config).__name__}")
        if not isinstance(backbone, Backbone):
            raise TypeError(f"backbone must be a leancompile.backbones.Backbone; got {type(backbone).__name__}")
        if config.use_cfg and uncond is None:
            raise ValueError(
                f"uncond (the negative-prompt conditioning) is required when guidance_scale > 1; "
                f"got guidance_scale={config.guidance_scale} and uncond=None"
            )
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        self.device = next(backbone.parameters()).device
        self.backbone = backbone.to(self.dtype)
        self.reward_fn = reward_fn
        self.encode = encode
        self.uncond = uncond.to(device=self.device, dtype=self.dtype) if uncond is not None else None
        self.step_fn = STEP_FUNCTIONS[config.step_kind]
        self.sigmas = shifted_sigmas(config.num_steps, config.shift, self.dtype).to(self.device)
        self.reference = self._prepare_parameters()
        self.sync = gradient_sync(config.parallel, self.backbone)
        if config.same_prompt_groups and config.group_size % self.sync.world_size:
            raise ValueError(f"group_size must be a multiple of the world size {self.sync.world_size} when "
                             f"same_prompt_groups=True; got {config.group_size}")
        self.trainable = [p for p in self.backbone.parameters() if p.requires_grad]
        self.trainable_names = [n for n, p in self.backbone.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.adam_weight_decay,
            eps=config.adam_epsilon,
        )
        self.ema = [p.detach().clone() for p in self.trainable] if config.ema else None
        self.generators = {name: torch.Generator().manual_seed(seed)
                           for name, seed in generator_seeds(config.seed, self.sync.rank).items()}
        self.global_step = 0
        self.optimizer_steps = 0

    # ----------------------------------------------------------------------------------------------- set-up

    def _prepare_parameters(self):
        """LoRA via peft (the reference is the same model with adapters disabled) or full fine-tuning (the
        reference is a frozen copy, kept only when the KL penalty needs it)."""
        cfg = self.config
        model = self.backbone.model
        if cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        if cfg.lora_rank is None:
            self.backbone.requires_grad_(True)
            if cfg.beta > 0:
                return copy.deepcopy(self.backbone).requires_grad_(False)
            return None
        from peft import LoraConfig

        self.backbone.requires_grad_(False)
        # peft initialises the adapters from the global generator; seed it so two runs start equal.
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha or cfg.lora_rank,
            target_modules=self.backbone.lora_target_modules(),
            init_lora_weights="gaussian",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model.add_adapter(lora)
        self.backbone.to(self.dtype)
        return None

    @contextlib.contextmanager
    def reference_model(self):
        """The KL reference: adapters disabled (LoRA) or the frozen initial weights (full fine-tuning)."""
        if self.reference is not None:
            yield self.reference
            return
        self.backbone.model.disable_adapters()
        try:
            yield self.backbone
        finally:
            self.backbone.model.enable_adapters()

    @property
    def samples_per_prompt(self) -> int:
        """This rank's samples of each prompt: the whole group, or its share under ``same_prompt_groups``."""
        cfg = self.config
        return cfg.group_size // self.sync.world_size if cfg.same_prompt_groups else cfg.group_size

    # ------------------------------------------------------------------------------------ backbone calls

    def model_timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The sigma the backbone is conditioned on (DanceGRPO quantises it)."""
        return sigma

    def autocast(self):
        if self.config.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def guided_velocity(self, model, x, sigma, cond: Conditioning, *, detach_uncond: bool = False) -> torch.Tensor:
        """The backbone's velocity, with classifier-free guidance over the doubled batch ``[uncond, cond]``."""
        t = self.model_timestep(sigma).to(x.dtype)
        if not self.config.use_cfg:
            with self.autocast():
                v = model(x, t, cond)
            return v.to(x.dtype)
        uncond = self.uncond.index(torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
        with self.autocast():
            v = model(torch.cat([x, x]), torch.cat([t, t]), Conditioning.cat([uncond, cond]))
        v_uncond, v_cond = v.to(x.dtype).chunk(2)
        if detach_uncond:
            v_uncond = v_uncond.detach()
        return v_uncond + self.config.guidance_scale * (v_cond - v_uncond)

    def rollout_velocity(self, step: int, rows: torch.Tensor, x, sigma, cond: Conditioning) -> torch.Tensor:
        """Backbone call site 1: the rollout's forward of step ``step`` for samples ``rows`` (no grad)."""
        with torch.no_grad():
            return self.guided_velocity(self.backbone, x, sigma, cond)

    def train_velocity(self, micro: MicroStep) -> torch.Tensor:
        """Backbone call site 2: the update's re-forward (with grad) of the rollout's inputs."""
        cfg = self.config
        if cfg.use_cfg and not cfg.train_cfg:
            with self.autocast():
                return self.backbone(micro.x, self.model_timestep(micro.sigma).to(micro.x.dtype), micro.cond).to(micro.x.dtype)
        return self.guided_velocity(self.backbone, micro.x, micro.sigma, micro.cond, detach_uncond=cfg.cfg_detach_uncond)

    def reference_velocity(self, micro: MicroStep) -> torch.Tensor:
        """Backbone call site 3: the KL reference's velocity at the update's inputs (no grad)."""
        with torch.no_grad(), self.reference_model() as ref:
            return self.guided_velocity(ref, micro.x, micro.sigma, micro.cond)

    # ------------------------------------------------------------------------------------------- rollout

    def sde_mask(self) -> torch.Tensor:
        """Which steps are stochastic; with an SDE window, its start is drawn from the ``steps`` generator."""
        cfg = self.config
        if cfg.sde_window_size == 0:
            return torch.ones(cfg.num_steps, dtype=torch.bool, device="cpu")
        lo, hi = cfg.window_range
        start = int(torch.randint(lo, hi - cfg.sde_window_size + 1, (1,), generator=self.generators["steps"], device="cpu"))
        mask = torch.zeros(cfg.num_steps, dtype=torch.bool, device="cpu")
        mask[start:start + cfg.sde_window_size] = True
        return mask

    def draw_noise(self, shape) -> torch.Tensor:
        # Drawn in float32 on the CPU whatever the run's dtype and device, so trajectories match across them.
        return torch.randn(shape, generator=self.generators["noise"], device="cpu").to(self.device, self.dtype)

    def rollout(self, prompts: Sequence) -> Rollout:
        cfg = self.config
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must hold at least one prompt; got an empty batch")
        per_prompt = self.samples_per_prompt
        num = len(prompts) * per_prompt
        cond = self.encode(prompts).repeat_interleave(per_prompt).to(device=self.device, dtype=self.dtype)
        x0 = self.draw_noise((num, *self.backbone.latent_shape))
        sde = self.sde_mask()
        chunk = cfg.sample_batch_size or num
        latents, log_probs = [], []
        for start in range(0, num, chunk):
            rows = torch.arange(start, min(start + chunk, num), device=self.device)
            x = x0[rows]
            traj, lps = [x], []
            for i in range(cfg.num_steps):
                x, lp = self.rollout_step(i, rows, x, cond.index(rows), bool(sde[i]))
                traj.append(x)
                lps.append(lp)
            latents.append(torch.stack(traj, dim=1))
            log_probs.append(torch.stack(lps, dim=1))
        rollout = Rollout(
            prompts=[p for p in prompts for _ in range(per_prompt)],
            cond=cond,
            latents=torch.cat(latents).detach(),
            log_probs=torch.cat(log_probs).detach(),
            sigmas=self.sigmas,
            sde_steps=sde,
        )
        rollout.rewards = check_rewards(self.reward_fn(rollout.final.float(), rollout.prompts), num).to(self.device)
        return rollout

    def rollout_step(self, step: int, rows: torch.Tensor, x, cond: Conditioning, sde: bool):
        """Denoising step ``step`` of samples ``rows``: the backbone call, then the SDE update and its log-prob (or a
        deterministic ODE update, log-prob 0). Returns ``(x_next, log_prob)``."""
        sigma = self.sigmas[step].expand(len(rows))
        sigma_next = self.sigmas[step + 1].expand(len(rows))
        v = self.rollout_velocity(step, rows, x, sigma, cond)
        if sde:
            res = self.step_fn(x, v, sigma, sigma_next, self.config.noise, noise=self.draw_noise(x.shape))
            return res.prev_sample, res.log_prob
        return ode_step(x, v, sigma, sigma_next), torch.zeros(len(rows), dtype=x.dtype, device=x.device)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-normalised advantages. With several ranks the rewards are all-gathered (as FlowGRPO gathers them)
        so that ``global_std`` sees them all, and, under ``same_prompt_groups``, a prompt's group is
        ``[rank 0's samples, rank 1's, ...]``; this rank keeps its own samples' advantages."""
        cfg = self.config
        normalise = functools.partial(group_advantages, group_size=cfg.group_size, unbiased=cfg.adv_unbiased,
                                      eps=cfg.adv_eps, global_std=cfg.global_std, clip=cfg.adv_clip_max)
        if self.sync.world_size == 1:
            return normalise(rewards).to(self.dtype)
        world, share = self.sync.world_size, self.samples_per_prompt
        gathered = self.sync.all_gather(rewards).view(world, -1, share)  # (rank, prompt, sample)
        grouped = normalise(gathered.transpose(0, 1).flatten()).view(-1, world, share)
        return grouped[:, self.sync.rank].flatten().to(self.dtype)

    # -------------------------------------------------------------------------------------------- update

    def trained_step_schedule(self, num_samples: int, sde_steps: torch.Tensor) -> torch.Tensor:
        """(B, k) step indices: row i's trained steps in the order they are trained."""
        cfg = self.config
        k, num = cfg.num_trained_steps, num_samples
        if cfg.trained_steps == "random":
            perms = [torch.randperm(cfg.num_steps, generator=self.generators["steps"], device="cpu")[:k] for _ in range(num)]
            return torch.stack(perms)
        steps = sde_steps.nonzero().flatten() if cfg.trained_steps == "window" else torch.arange(k, device="cpu")
        return steps[:k].expand(num, k).clone()

    def micro_batches(self, advantages: torch.Tensor) -> list[torch.Tensor]:
        """This epoch's shuffled micro-batches of sample indices (zero-advantage samples dropped if configured)."""
        cfg = self.config
        kept = (advantages != 0).nonzero().flatten().cpu() if cfg.drop_zero_advantages else torch.arange(len(advantages), device="cpu")
        order = kept[torch.randperm(len(kept), generator=self.generators["shuffle"], device="cpu")]
        return list(order.split(cfg.train_batch_size)) if len(order) else []

    def micro_step(self, rollout: Rollout, advantages: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> MicroStep:
        rows, steps = rows.to(self.device), steps.to(self.device)
        return MicroStep(
            rows=rows,
            steps=steps,
            x=rollout.latents[rows, steps],
            prev_sample=rollout.latents[rows, steps + 1],
            sigma=rollout.sigmas[steps],
            sigma_next=rollout.sigmas[steps + 1],
            cond=rollout.cond.index(rows),
            log_prob_old=rollout.log_probs[rows, steps],
            advantages=advantages[rows],
        )

    def micro_step_loss(self, micro: MicroStep) -> tuple[torch.Tensor, dict]:
        """The clipped PPO loss of one micro-step, plus ``beta`` times the KL to the reference."""
        cfg = self.config
        v = self.train_velocity(micro)
        res = self.step_fn(micro.x, v, micro.sigma, micro.sigma_next, cfg.noise, prev_sample=micro.prev_sample)
        ratio = torch.exp(res.log_prob - micro.log_prob_old)
        adv = micro.advantages
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
        policy_loss = torch.mean(torch.maximum(unclipped, clipped))
        loss = policy_loss
        info = {
            "policy_loss": policy_loss.detach(),
            "clipfrac": (torch.abs(ratio - 1) > cfg.clip_range).to(ratio.dtype).mean().detach(),
            "approx_kl": (0.5 * (res.log_prob - micro.log_prob_old) ** 2).mean().detach(),
        }
        if cfg.beta > 0:
            v_ref = self.reference_velocity(micro)
            with torch.no_grad():
                mean_ref = self.step_fn(micro.x, v_ref, micro.sigma, micro.sigma_next, cfg.noise,
                                        prev_sample=micro.prev_sample).mean
            dims = tuple(range(1, res.mean.dim()))
            kl = ((res.mean - mean_ref) ** 2).mean(dim=dims) / (2 * res.std**2)
            loss = loss + cfg.beta * kl.mean()
            info["kl"] = kl.mean().detach()
        return loss, info

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """``sync``: this backward completes the optimizer step's gradient (data parallel: average it across
        ranks); the others accumulate locally."""
        with self.sync.backward(sync):
            loss.backward()

    def optimizer_step(self) -> None:
        cfg = self.config
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.trainable], 1 - cfg.ema_decay)

    def update(self, rollout: Rollout, advantages: torch.Tensor) -> dict:
        cfg = self.config
        k = cfg.num_trained_steps
        scale = 1.0 / (cfg.gradient_accumulation_steps * k)
        totals: dict[str, float] = {}
        count = 0
        for _ in range(cfg.num_inner_epochs):
            schedule = self.trained_step_schedule(rollout.num_samples, rollout.sde_steps)
            batches = self.micro_batches(advantages)
            for b, rows in enumerate(batches):
                optimizer_step_follows = (b + 1) % cfg.gradient_accumulation_steps == 0 or b == len(batches) - 1
                for j in range(k):
                    micro = self.micro_step(rollout, advantages, rows, schedule[rows, j])
                    loss, info = self.micro_step_loss(micro)
                    self.backward(loss * scale, sync=optimizer_step_follows and j == k - 1)
                    for key, value in {"loss": loss.detach(), **info}.items():
                        totals[key] = totals.get(key, 0.0) + float(value)
                    count += 1
                if optimizer_step_follows:
                    self.optimizer_step()
        return {key: value / max(count, 1) for key, value in totals.items()}

    # ---------------------------------------------------------------------------------------------- step

    def step(self, prompts: Sequence) -> dict:
        """One GRPO step: rollout, advantages, update. Returns scalar statistics."""
        t0 = time.perf_counter()
        gathers = self.sync.gathers
        rollout = self.rollout(prompts)
        t1 = time.perf_counter()
        advantages = self.advantages(rollout.rewards)
        steps_before, syncs, collectives = self.optimizer_steps, self.sync.syncs, self.sync.collectives
        stats = self.update(rollout, advantages)
        t2 = time.perf_counter()
        self.global_step += 1
        rewards = rollout.rewards
        stats.update(
            step=self.global_step,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(correction=0)),
            kept_fraction=float((advantages != 0).float().mean()) if self.config.drop_zero_advantages else 1.0,
            optimizer_steps=self.optimizer_steps - steps_before,
            gradient_syncs=self.sync.syncs - syncs,
            gradient_collectives=self.sync.collectives - collectives,
            weight_gathers=self.sync.gathers - gathers,
            rollout_seconds=t1 - t0,
            update_seconds=t2 - t1,
            step_seconds=t2 - t0,
        )
        self.last_rollout = rollout
        return stats

    # ------------------------------------------------------------------------------------ state helpers

    def ema_parameters(self) -> dict[str, torch.Tensor]:
        """The EMA of the trainable weights by parameter name (empty when ``ema`` is off)."""
        return dict(zip(self.trainable_names, self.ema)) if self.ema is not None else {}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.trainable_names, self.trainable)}

    def save(self, path) -> None:
        """Write the full training state atomically (see :mod:`leancompile.trainers.checkpoint`)."""
        save_checkpoint(self, path)

    def load(self, path) -> None:
        """Restore the state written by :meth:`save` into this trainer (same config and backbone)."""
        load_checkpoint(self, path)


class FlowGRPOTrainer(GRPOTrainer):
    """FlowGRPO (SDE or CPS steps); the backbone sees the continuous sigma."""

    config_class = FlowGRPOConfig


class DanceGRPOTrainer(GRPOTrainer):
    """DanceGRPO; the backbone sees ``int(sigma * 1000) / 1000``."""

    config_class = DanceGRPOConfig

    def model_timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return quantized_timestep(sigma)


# The trainer families by their config's algorithm name: the one place that lists them.
TRAINERS: dict[str, type[GRPOTrainer]] = {cls.config_class.algorithm: cls for cls in (FlowGRPOTrainer, DanceGRPOTrainer)}


def trainer_class(algorithm: str) -> type[GRPOTrainer]:
    """The native trainer of ``algorithm`` (its config class is ``.config_class``)."""
    if algorithm not in TRAINERS:
        raise ValueError(f"algorithm must be one of {sorted(TRAINERS)}; got {algorithm!r}")
    return TRAINERS[algorithm]
