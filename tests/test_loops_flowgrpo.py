"""``leancompile.wrap`` in a loop that calls the transformer the way FlowGRPO's ``train_sd3.py`` does.

A tiny SD3 transformer (float64) with a peft LoRA is wrapped where such a script has the module: after
``get_peft_model``, before ``accelerator.prepare(transformer, optimizer)`` (or after it, in one process, where
``prepare`` hands back the module itself). The rollout runs through a pipeline-like sampler in ``eval()`` under
``torch.no_grad()``, classifier-free guidance by batch doubling, calling the transformer with
``joint_attention_kwargs=None``; the update runs in ``train()`` without that argument, on samples shuffled across
the rollout's batches (``randperm``), through ``accelerator.accumulate`` with two optimizer steps per epoch, and a
KL term to the same module with its adapters disabled (``transformer.module.disable_adapter()`` under DDP). Every
update call before an epoch's first optimizer step is served, and the weights follow native's to float64 rounding.

FlowGRPO casts the transformer's output with ``.float()`` before its SDE step; in these float64 runs the cast is
to float64 (a float32 cast would round served and native outputs, which differ in the last float64 bits, to
float32 neighbours apart, and measure the cast instead of the engine).
"""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import flow_sde_step, shifted_sigmas
from conftest import spawn_ranks

DTYPE = torch.float64
NUM_STEPS, TRAIN_STEPS = 3, 2  # FlowGRPO trains the first int(num_steps * timestep_fraction) steps
SAMPLE_BATCH, SAMPLE_BATCHES, TRAIN_BATCH = 4, 2, 2
# Micro-steps per optimizer step: two optimizer steps per epoch, as FlowGRPO's accumulation over the trained steps
ACCUMULATION = SAMPLE_BATCH * SAMPLE_BATCHES // TRAIN_BATCH * TRAIN_STEPS // 2
GUIDANCE, NOISE_LEVEL, BETA, CLIP_RANGE, ADV_CLIP_MAX = 4.5, 0.7, 0.04, 1e-4, 5.0
EPOCHS = 2
LATENT_SHAPE = backbones.tiny("sd3").latent_shape


def cast(noise_pred: torch.Tensor) -> torch.Tensor:
    """FlowGRPO's ``noise_pred.float()``, to the run's float (see the module's docstring)."""
    return noise_pred.to(DTYPE)


@torch.no_grad()
def pipeline_with_logprob(transformer, prompt_embeds, pooled, negative, sigmas, generator):
    """A diffusers-style sampler: CFG by batch doubling ``[uncond, cond]``, ``joint_attention_kwargs=None`` passed
    as a pipeline passes its attribute, the SDE step with its log-probability."""
    batch = prompt_embeds.shape[0]
    embeds = torch.cat([negative[0].expand_as(prompt_embeds), prompt_embeds])
    pooled_embeds = torch.cat([negative[1].expand_as(pooled), pooled])
    latents = torch.randn((batch, *LATENT_SHAPE), generator=generator, dtype=DTYPE)
    all_latents, log_probs, timesteps = [latents], [], (sigmas[:-1] * 1000).repeat(batch, 1)
    for i, t in enumerate(sigmas[:-1] * 1000):
        latent_model_input = torch.cat([latents] * 2)
        noise_pred = transformer(hidden_states=latent_model_input, timestep=t.expand(latent_model_input.shape[0]),
                                 encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
                                 joint_attention_kwargs=None, return_dict=False)[0]
        uncond, text = noise_pred.chunk(2)
        noise_pred = uncond + GUIDANCE * (text - uncond)
        step = flow_sde_step(latents, cast(noise_pred), sigmas[i].expand(batch), sigmas[i + 1].expand(batch),
                             NOISE_LEVEL, noise=torch.randn(latents.shape, generator=generator, dtype=DTYPE))
        latents = step.prev_sample
        all_latents.append(latents)
        log_probs.append(step.log_prob)
    return torch.stack(all_latents, 1), torch.stack(log_probs, 1), timesteps



def compute_log_prob(transformer, sample, j, embeds, pooled, sigmas):
    """The update's call: the stored latents doubled, no ``joint_attention_kwargs``."""
    noise_pred = transformer(hidden_states=torch.cat([sample["latents"][:, j]] * 2),
                             timestep=torch.cat([sample["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)[0]
    uncond, text = noise_pred.chunk(2)
    noise_pred = cast(uncond + GUIDANCE * (text - uncond))
    rows = sample["latents"].shape[0]
    return flow_sde_step(sample["latents"][:, j], noise_pred, sigmas[j].expand(rows), sigmas[j + 1].expand(rows),
                         NOISE_LEVEL, prev_sample=sample["latents"][:, j + 1])


def run(use_leancompile: bool, where: str = "before prepare", seed: int = 0, zero_stage: int | None = None) -> dict:
    """``EPOCHS`` epochs of the loop on this process (a DDP rank where a process group is up); returns the change
    of the trainable weights, the rewards, and the wrapped module's stats at each optimizer step."""
    base = backbones.tiny("sd3", seed=0, dtype=DTYPE)
    lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                      target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(0)  # the LoRA's draws: the same model on every rank and in both runs
    transformer = get_peft_model(base.model, lora)
    if use_leancompile and where == "before prepare":
        transformer = leancompile.wrap(transformer)
    inner = transformer  # FlowGRPO's pipeline.transformer: the rollout calls the module, not what prepare returns
    params = [p for p in transformer.parameters() if p.requires_grad]
    # Plain SGD: Adam's first steps are sign-like and would hide a gradient's difference.
    optimizer = torch.optim.SGD(params, lr=0.5)
    plugin = None
    if zero_stage is not None:  # FlowGRPO's multi-GPU config: DeepSpeed through accelerate
        from accelerate.utils import DeepSpeedPlugin
        plugin = DeepSpeedPlugin(zero_stage=zero_stage, gradient_accumulation_steps=ACCUMULATION)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, deepspeed_plugin=plugin)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    if use_leancompile and where == "after prepare":
        transformer = inner = leancompile.wrap(transformer)
    ddp = transformer is not inner  # DDP or DeepSpeed's engine around the module: FlowGRPO's .module
    stats = []
    if use_leancompile:
        optimizer.optimizer.register_step_pre_hook(lambda *_: stats.append(inner.stats()))

    generator = torch.Generator().manual_seed(1000 + seed)  # each rank samples its own prompts and noise
    text = base.dummy_conditioning(3, torch.Generator().manual_seed(seed), dtype=DTYPE)
    negative = (text.text[:1], text.pooled[:1])
    sigmas = shifted_sigmas(NUM_STEPS, 3.0, DTYPE)
    target = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(7), dtype=DTYPE)
    start = torch.cat([p.detach().flatten() for p in params])
    rewards_seen = []
    for _ in range(EPOCHS):
        inner.eval()
        samples = []
        for _ in range(SAMPLE_BATCHES):
            prompts = torch.randint(1, 3, (SAMPLE_BATCH,), generator=generator)
            latents, log_probs, timesteps = pipeline_with_logprob(inner, text.text[prompts], text.pooled[prompts],
                                                                  negative, sigmas, generator)
            samples.append(dict(latents=latents, log_probs=log_probs, timesteps=timesteps, prompts=prompts,
                                prompt_embeds=text.text[prompts], pooled=text.pooled[prompts]))
        samples = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
        rewards = -((samples["latents"][:, -1] - target) ** 2).mean(dim=(1, 2, 3))
        rewards_seen.append(rewards)
        advantages = torch.zeros_like(rewards)  # per prompt, population std, clipped
        for prompt in samples["prompts"].unique():
            mask = samples["prompts"] == prompt
            group = rewards[mask]
            advantages[mask] = (group - group.mean()) / (group.std(unbiased=False) + 1e-4)
        samples["advantages"] = advantages
        perm = torch.randperm(len(rewards), generator=generator)  # shuffled across the rollout's batches
        samples = {k: v[perm] for k, v in samples.items()}

        transformer.train()
        for b in range(0, len(rewards), TRAIN_BATCH):
            sample = {k: v[b:b + TRAIN_BATCH] for k, v in samples.items()}
            embeds = torch.cat([negative[0].repeat(TRAIN_BATCH, 1, 1), sample["prompt_embeds"]])
            pooled = torch.cat([negative[1].repeat(TRAIN_BATCH, 1), sample["pooled"]])
            for j in range(TRAIN_STEPS):
                with accelerator.accumulate(transformer):
                    step = compute_log_prob(transformer, sample, j, embeds, pooled, sigmas)
                    with torch.no_grad(), (transformer.module if ddp else transformer).disable_adapter():
                        reference = compute_log_prob(transformer, sample, j, embeds, pooled, sigmas)
                    kl = ((step.mean - reference.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * step.std.flatten() ** 2)
                    adv = torch.clamp(sample["advantages"], -ADV_CLIP_MAX, ADV_CLIP_MAX)
                    ratio = torch.exp(step.log_prob - sample["log_probs"][:, j])
                    unclipped = -adv * ratio
                    clipped = -adv * torch.clamp(ratio, 1 - CLIP_RANGE, 1 + CLIP_RANGE)
                    loss = torch.mean(torch.maximum(unclipped, clipped)) + BETA * kl.mean()
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(transformer.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
    change = torch.cat([p.detach().flatten() for p in params]) - start
    return dict(change=change, rewards=torch.cat(rewards_seen), stats=stats)


def check(native: dict, wrapped: dict) -> None:
    assert torch.allclose(wrapped["rewards"], native["rewards"], rtol=1e-10, atol=0)
    assert native["change"].norm() > 0
    assert float((wrapped["change"] - native["change"]).norm() / native["change"].norm()) <= 1e-10
    steps = wrapped["stats"]
    assert len(steps) == 2 * EPOCHS
    for epoch in range(EPOCHS):
        first, second = steps[2 * epoch], steps[2 * epoch + 1]
        # Every call with grad before the epoch's first optimizer step served; after it the weights differ.
        assert first["served_calls"] == ACCUMULATION and first["recomputed_calls"] == 0, first
        assert second["served_calls"] == 0 and set(second["recompute_reasons"]) == {"weights"}, second


@pytest.fixture(scope="module")
def native():
    return run(False)


@pytest.mark.parametrize("where", ["before prepare", "after prepare"])
def test_flowgrpo_style_loop_with_accelerate_serves_the_update_before_each_first_step(native, where):
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)
        wrapped = run(True, where)
    check(native, wrapped)


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {use: run(use, seed=rank) for use in (False, True)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_flowgrpo_style_loop_under_ddp_serves_the_update_before_each_first_step(tmp_path):
    """Two gloo ranks: ``prepare`` puts the wrapped module in DDP, the rollout calls the module itself (the
    pipeline's), the update calls DDP and the KL reference runs under ``transformer.module.disable_adapter()``."""
    ranks = spawn_ranks(_worker, 2, tmp_path)
    for rank in ranks:
        check(rank[False], rank[True])
    assert torch.equal(ranks[0][True]["change"], ranks[1][True]["change"])  # DDP keeps the ranks in sync


def _deepspeed_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    results = {use: run(use, zero_stage=2) for use in (False, True)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_flowgrpo_style_loop_under_deepspeed_zero2_serves_the_update_before_each_first_step(tmp_path):
    """ZeRO-2 through accelerate (DeepSpeed's CPU accelerator, gloo): it shards gradients and optimizer states,
    not the parameters the calls read, so the calls are served as without it."""
    pytest.importorskip("deepspeed")
    (rank,) = spawn_ranks(_deepspeed_worker, 1, tmp_path)
    check(rank[False], rank[True])
