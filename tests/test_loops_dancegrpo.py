"""``leancompile.wrap`` in a loop that shards and calls a Flux transformer the way DanceGRPO's
``train_grpo_flux.py`` does: FSDP1 ``FullyShardedDataParallel`` with FULL_SHARD and a per-block auto-wrap policy
(found by a function that tests ``isinstance(transformer, FluxTransformer2DModel)``), non-reentrant activation
checkpointing on every block, the rollout in ``eval()`` under ``torch.no_grad()`` one sample per call, the update
in ``train()`` with the steps drawn per sample after the rollout, FSDP's ``clip_grad_norm_`` and an optimizer step
every ``ACCUMULATION`` samples. Wrapped after FSDP1 or before it (with ``use_orig_params`` either way), the loop
never breaks and trains as FSDP1 alone to float64 rounding; FSDP1 swaps flat shards in and out around each call,
so its calls run natively and the wrapper says why (``stats()``, ``last_calls``, a ``NothingServedWarning``).

One gloo rank (a world of one, in this process): FSDP1 runs its whole protocol (flat parameters, unshard and
reshard, reduce-scatter) at any world size."""
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import leancompile
from examples import dancegrpo_flux

ACCUMULATION = 2  # samples per optimizer step: two optimizer steps per rollout of four samples
BLOCKS = (FluxTransformerBlock, FluxSingleTransformerBlock)


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def get_dit_fsdp_kwargs(transformer, use_orig_params: bool) -> dict:
    """FSDP1's arguments for a diffusion transformer, its blocks found by its class."""
    if not isinstance(transformer, FluxTransformer2DModel):
        raise ValueError(f"no FSDP policy for {type(transformer).__name__}")
    return dict(auto_wrap_policy=ModuleWrapPolicy(set(BLOCKS)), sharding_strategy=ShardingStrategy.FULL_SHARD,
                use_orig_params=use_orig_params, device_id=torch.device("cpu"))  # FSDP1 on the CPU: gloo


class PerSampleSteps:
    """DanceGRPO's update: per sample its own randomly drawn trained steps, FSDP's ``clip_grad_norm_`` and an
    optimizer step every ``ACCUMULATION`` samples (several per rollout)."""

    def train(self, samples: dict, rewards: torch.Tensor) -> None:
        c = self.config
        grouped = rewards.reshape(-1, c.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-8)).reshape(-1)
        trained = int((c.num_steps - 1) * c.timestep_fraction)
        perms = torch.stack([torch.randperm(c.num_steps - 1, generator=self.generator) for _ in rewards])
        for n in range(len(rewards)):
            for j in perms[n, :trained].tolist():
                (self.loss(samples, advantages, n, j) / (ACCUMULATION * trained)).backward()
            if (n + 1) % ACCUMULATION == 0:
                self.transformer.clip_grad_norm_(1.0)  # FSDP's own: the norm over every shard
                self.optimizer.step()
                self.optimizer.zero_grad()


class FSDP1Flux(PerSampleSteps, dancegrpo_flux.Loop):
    """The example's Flux loop with its transformer in FSDP1 and activation checkpointing, wrapped ``where``
    (``None``: not wrapped)."""

    def __init__(self, config, where: str | None, use_orig_params: bool = False):
        super().__init__(config, use_leancompile=False)
        transformer = self.transformer
        transformer.disable_gradient_checkpointing()  # the checkpoint wrappers below take its place
        if where == "before":
            transformer = leancompile.wrap(transformer)
        transformer = FullyShardedDataParallel(transformer, **get_dit_fsdp_kwargs(transformer, use_orig_params))
        apply_activation_checkpointing(
            transformer, check_fn=lambda m: isinstance(m, BLOCKS),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        if where == "after":
            transformer = leancompile.wrap(transformer)
        self.transformer = transformer
        self.wrapped = transformer.module if where == "before" else transformer if where else None
        # Plain SGD: Adam's first steps are sign-like and would hide a gradient's difference.
        self.optimizer = torch.optim.SGD(transformer.parameters(), lr=0.05)
        self.applied = []  # the gradient each optimizer step applies
        self.optimizer.register_step_pre_hook(lambda *_: self.applied.append(
            torch.cat([p.grad.flatten() for p in self.transformer.parameters()])))

    def step(self) -> float:
        self.transformer.eval()
        samples = self.rollout()
        rewards = -((samples["latents"][:, -1] - self.target) ** 2).mean(dim=(1, 2))
        self.transformer.train()
        self.train(samples, rewards)
        return float(rewards.mean())


CONFIG = dancegrpo_flux.Config(num_steps=4, dtype=torch.float64)


def _run(where, use_orig_params):
    loop = FSDP1Flux(CONFIG, where, use_orig_params)
    start = torch.cat([p.detach().flatten() for p in loop.transformer.parameters()])
    rewards = [loop.step() for _ in range(2)]
    change = torch.cat([p.detach().flatten() for p in loop.transformer.parameters()]) - start
    return loop, rewards, change


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("where", ["after", "before"])
def test_dancegrpo_style_fsdp1_loop_never_breaks_and_says_why_it_runs_natively(where, use_orig_params):
    _, native_rewards, native_change = _run(None, use_orig_params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop, rewards, change = _run(where, use_orig_params)
    assert rewards == pytest.approx(native_rewards, rel=1e-10)
    assert native_change.norm() > 0
    assert float((change - native_change).norm() / native_change.norm()) <= 1e-10
    assert len(loop.applied) == 2 * 2  # two optimizer steps per rollout, two rollouts
    told = [w for w in caught if issubclass(w.category, leancompile.NothingServedWarning)]
    reasons = {r.reason for r in loop.wrapped.last_calls if r.action == "recomputed"}
    stats = loop.wrapped.stats()
    if stats["served_calls"]:
        assert not told
    else:  # FSDP1 runs natively, and everything says so
        assert told and all("FSDP1" in str(w.message) for w in told), [str(w.message) for w in told]
        trained = int((CONFIG.num_steps - 1) * CONFIG.timestep_fraction)
        assert len(reasons) == 1 and "FSDP1" in reasons.pop()
        assert stats["recompute_reasons"] == {"unsupported": 2 * CONFIG.prompts * CONFIG.group * trained}, stats
