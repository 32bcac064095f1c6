"""Data parallel on torch.distributed: two gloo processes run native, Retain and Reweight under DDP and FSDP2.

Each case trains one GRPO step on two ranks; the reference is the single-process native trainer on each rank's
data (its prompts and its generators), the gradients averaged, then one optimizer step. Weights and the applied
gradient must agree to float64 rounding, and every optimizer step must synchronise the gradients exactly once.
"""
import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from leancompile import optimize
from leancompile.cost import live_device, plan, trainer_scenario
from leancompile.cost.scenario import reweight_buffers
from leancompile.schedules import estimators
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig
from leancompile.trainers.advantages import group_advantages
from leancompile.trainers.grpo import generator_seeds

from conftest import spawn_ranks
from saved_memory import LiveSavedTensors, static_bytes
from test_reweight_equivalence import _build

WORLD = 2
FLOW = FlowGRPOConfig(num_steps=3, group_size=4, train_batch_size=8, guidance_scale=2.0, beta=0.1, dtype="float64",
                      drop_zero_advantages=False, max_grad_norm=None)
DANCE = DanceGRPOConfig(num_steps=4, group_size=4, gradient_accumulation_steps=4, dtype="float64",
                        drop_zero_advantages=False, max_grad_norm=1.0)
HALF = dataclasses.replace(FLOW, train_batch_size=4)  # same prompts: two optimizer steps of the standard layout


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: object
    parallel: str
    schedule: str
    prompts_per_rank: int = 2
    same_prompt: bool = False
    memory_budget: float | None = None
    reweighted: float = 1.0  # the share of the blocks' parameters Reweight keeps per-sample gradients of

    def prompts(self, rank: int) -> list[int]:
        if self.same_prompt:  # every rank samples the same prompts
            return list(range(1, 1 + self.prompts_per_rank))
        return [1 + rank * self.prompts_per_rank + i for i in range(self.prompts_per_rank)]

    def rank_config(self):
        return dataclasses.replace(self.config, parallel=self.parallel, same_prompt_groups=self.same_prompt)


CASES = [Case(f"{parallel}-{schedule}", FLOW, parallel, schedule)
         for parallel in ("ddp", "fsdp") for schedule in ("native", "retain", "reweight")]
CASES += [Case("dance-ddp-auto", DANCE, "ddp", "auto", prompts_per_rank=1)]
CASES += [Case("fsdp-auto", FLOW, "fsdp", "auto"), Case("fsdp-retain@0.25", FLOW, "fsdp", "retain", memory_budget=0.25),
          Case("fsdp-reweight@0.5", FLOW, "fsdp", "reweight", reweighted=0.5)]
CASES += [Case("same-ddp-reweight", HALF, "ddp", "reweight", same_prompt=True)]
CASES += [Case(f"two-steps-{parallel}-{schedule}", HALF, parallel, schedule)
          for parallel in ("ddp", "fsdp") for schedule in ("native", "retain")]


def _full(trainer, tensors):
    return torch.cat([trainer.sync.full(t).detach().flatten().double() for t in tensors])


def _worker(rank, port, cases, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        trainer = _build("sd3", case.rank_config())
        before = trainer.sync.gathers
        if case.schedule != "native":
            trainer = optimize(trainer, schedule=case.schedule, memory_budget=case.memory_budget)
            if case.reweighted < 1:  # as the planner's reweight@f
                trainer.plan = dataclasses.replace(trainer.plan, steps=tuple(
                    dataclasses.replace(a, fraction=case.reweighted) if a.keeps else a for a in trainer.plan.steps))
        compile_gathers = trainer.sync.gathers - before
        grads = []
        trainer.optimizer.register_step_pre_hook(
            lambda *_: grads.append(_full(trainer, [p.grad for p in trainer.trainable])))
        tracker = LiveSavedTensors.of(trainer)
        with tracker.tracking():
            stats = trainer.step(case.prompts(rank))
        plan = getattr(trainer, "plan", None)
        results[case.name] = dict(stats=stats, weights=_full(trainer, trainer.trainable), grads=grads,
                                  per_block=getattr(trainer.sync, "per_block", False), compile_gathers=compile_gathers,
                                  schedule=str(plan.schedule) if plan else "native", choice=plan.choice if plan else "",
                                  # this rank's peak: static (its shards), autograd's saved tensors, what the engine kept
                                  peak=static_bytes(trainer) + tracker.peak + stats.get("retained_bytes", 0)
                                  + stats.get("buffer_bytes", 0))
        if case.name == "fsdp-native":
            results["predicted"] = _predicted(trainer, len(case.prompts(rank)) * case.config.group_size)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _predicted(trainer, samples: int) -> dict:
    """The planner's peak per rank for native and Retain (per block) on this trainer, profiled on the gathered
    weights as optimize() does."""
    with trainer.sync.whole_weights(trainer) as (backbone, trainable):
        view = copy.copy(trainer)
        view.__dict__.update(backbone=backbone, trainable=trainable)
        scenario = trainer_scenario(view, samples, world_size=WORLD, sharding="fsdp", advantage_free=True,
                                    buffers=reweight_buffers(trainer.config, True, samples))
        cost = plan(scenario, live_device("cpu"), 1 << 50, estimators=estimators())
    # The measured peak sums what a rank holds besides the block weights FSDP2 gathers around each call (the CPU has
    # no allocator peak that would show them): the planner's gathered blocks are left out of its side too.
    return {name: cost[name].peak_bytes - dict(cost[name].components).get("gathered blocks", 0)
            for name in ("native", "retain", "reweight")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("ranks"), CASES)


def _reference(case):
    """One optimizer step of the averaged single-process native gradients of every rank's data; returns the
    applied gradient and the weights after it."""
    per_prompt = case.config.group_size // WORLD if case.same_prompt else case.config.group_size
    single = dataclasses.replace(case.config, group_size=per_prompt)
    trainers, rollouts = [], []
    for rank in range(WORLD):
        trainer = _build("sd3", single)
        for name, seed in generator_seeds(single.seed, rank).items():
            trainer.generators[name].manual_seed(seed)
        trainers.append(trainer)
        rollouts.append(trainer.rollout(case.prompts(rank)))
    rewards = torch.stack([r.rewards for r in rollouts]).view(WORLD, case.prompts_per_rank, per_prompt)
    cfg = case.config
    advantages = group_advantages(rewards.transpose(0, 1).flatten(), cfg.group_size, unbiased=cfg.adv_unbiased,
                                  eps=cfg.adv_eps, clip=cfg.adv_clip_max).view(-1, WORLD, per_prompt)
    grads = []
    for rank, (trainer, rollout) in enumerate(zip(trainers, rollouts)):
        stashed = []
        trainer.optimizer_step = lambda t=trainer, s=stashed: s.append([p.grad.clone() for p in t.trainable])
        trainer.update(rollout, advantages[:, rank].flatten().to(trainer.dtype))
        assert len(stashed) == 1, "the reference covers one optimizer step per GRPO step"
        grads.append(stashed[0])
    final = trainers[0]
    for p, *rank_grads in zip(final.trainable, *grads):
        p.grad = sum(rank_grads) / WORLD
    applied = []
    final.optimizer.register_step_pre_hook(lambda *_: applied.append(_full(final, [p.grad for p in final.trainable])))
    type(final).optimizer_step(final)
    start = _full(final, _build("sd3", single).trainable)
    return applied[0], _full(final, final.trainable), start


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", [c for c in CASES if not c.name.startswith("two-steps")], ids=lambda c: c.name)
def test_data_parallel_step_equals_single_process_native(ranks, case):
    grad, weights, start = _reference(case)
    for rank in ranks:
        result = rank[case.name]
        assert _relative(result["grads"][0], grad) <= 1e-10
        assert _relative(result["weights"] - start, weights - start) <= 1e-10
    assert torch.equal(ranks[0][case.name]["weights"], ranks[1][case.name]["weights"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_gradient_sync_per_optimizer_step(ranks, case):
    """Every program syncs in the last backward before each optimizer step (a served call's gradients arrive in
    that backward); the provisional backwards of Reweight's rollout never communicate."""
    # DDP: one all-reduce per bucket (one bucket here). FSDP2: one reduce-scatter per sharded module with gradients
    # (the two transformer blocks, where the adapters live), natively and per block under Retain and Reweight.
    per_sync = 2 if case.parallel == "fsdp" else 1
    for rank in ranks:
        stats = rank[case.name]["stats"]
        assert stats["gradient_syncs"] == stats["optimizer_steps"] == (2 if case.name.startswith("two-steps") else 1)
        assert stats["gradient_collectives"] == per_sync * stats["gradient_syncs"]


def test_what_each_engine_runs(ranks):
    results = ranks[0]
    assert results["ddp-retain"]["schedule"] == "retain" and results["ddp-reweight"]["schedule"] == "reweight"
    assert results["ddp-retain"]["stats"]["served_calls"] > 0
    assert results["same-ddp-reweight"]["stats"]["served_calls"] > 0  # groups span the ranks
    assert results["fsdp-retain"]["schedule"] == "retain" and results["fsdp-reweight"]["schedule"] == "reweight"
    assert results["fsdp-retain"]["stats"]["served_calls"] > 0
    # auto under FSDP2: the planner's mix, run per block
    assert results["fsdp-auto"]["per_block"] and results["fsdp-auto"]["stats"]["served_calls"] > 0, \
        results["fsdp-auto"]["choice"]
    # after the first optimizer step the weights differ from the rollout's: the second step's micro-steps recompute
    for parallel in ("ddp", "fsdp"):
        two = results[f"two-steps-{parallel}-retain"]
        assert two["stats"]["served_calls"] == two["stats"]["recomputed_calls"] > 0, two["stats"]
        assert _relative(two["weights"], results[f"two-steps-{parallel}-native"]["weights"]) <= 1e-12


def test_fsdp_runs_per_block_under_fsdp2s_own_gathers(ranks):
    """Retain and Reweight under FSDP2 keep the per-block sharding (no gather of the whole model) and reduce-scatter
    per block as native does. Retain all-gathers each block's weights exactly when native's does and serves every
    block call of the micro-steps before the optimizer step. Reweight's loss heads run the module's forward again
    (gathering no block whose kept output is answered) and its backward (the per-row backward needs the weights):
    more gathers than native's (36 against 20 here)."""
    for rank in ranks:
        native, retain, reweight = (rank[f"fsdp-{name}"]["stats"] for name in ("native", "retain", "reweight"))
        assert retain["weight_gathers"] == native["weight_gathers"] > 0
        assert retain["gradient_collectives"] == reweight["gradient_collectives"] == native["gradient_collectives"]
        for stats in (retain, reweight):
            assert stats["served_calls"] > 0 and stats["recomputed_calls"] == 0, stats
        # (twice native's if the heads' forward gathered the blocks it answers too)
        assert native["weight_gathers"] < reweight["weight_gathers"] < 2 * native["weight_gathers"]
        assert rank["fsdp-retain"]["per_block"] and rank["fsdp-reweight"]["per_block"]
        # Retain at activation budget 0.25: each block's partition keeps less and recomputes the rest in its
        # backward, on the weights FSDP2 gathered for it; every call still served, gathered as native's
        partial = rank["fsdp-retain@0.25"]
        assert partial["per_block"] and partial["stats"]["weight_gathers"] == native["weight_gathers"]
        assert partial["stats"]["served_calls"] == retain["served_calls"] and partial["stats"]["recomputed_calls"] == 0
        assert 0 < partial["stats"]["retained_bytes"] < retain["retained_bytes"]
        # Reweight of the last block: the first recomputes in the update, natively under FSDP2's hooks
        last = rank["fsdp-reweight@0.5"]["stats"]
        assert 0 < last["served_calls"] < reweight["served_calls"] and last["recomputed_calls"] > 0
        assert 0 < last["buffer_bytes"] < reweight["buffer_bytes"]
        assert native["weight_gathers"] < last["weight_gathers"] <= reweight["weight_gathers"]
        # optimize() traces and analyses on fake whole weights: per block, nothing is gathered before the step.
        assert rank["fsdp-retain"]["compile_gathers"] == rank["fsdp-reweight"]["compile_gathers"] == 0


def test_peak_memory_per_rank_is_within_ten_percent_of_the_planners(ranks):
    """Under FSDP2 each rank holds its shards, one call's activations and (Retain per block) its kept activations or
    (Reweight per block) its per-row gradients, block cotangents and input gradients, and one kept call's
    activations until its step's provisional backward: measured (shard sizes, saved-tensor hooks, the engine's
    held bytes) against the planner's peak per rank."""
    for rank in ranks:
        for name in ("native", "retain", "reweight"):
            measured, predicted = rank[f"fsdp-{name}"]["peak"], rank["predicted"][name]
            assert abs(predicted - measured) <= 0.1 * measured, (name, predicted, measured)


def test_bad_data_parallel_settings_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="same_prompt_groups must be False when parallel='none'"):
        dataclasses.replace(FLOW, same_prompt_groups=True)
    with pytest.raises(ValueError, match="drop_zero_advantages must be False when parallel != 'none'"):
        dataclasses.replace(FLOW, parallel="ddp", drop_zero_advantages=True)
    with pytest.raises(ValueError, match="parallel must be one of"):
        dataclasses.replace(FLOW, parallel="deepspeed")
    with pytest.raises(ValueError, match="needs torch.distributed initialised: launch with torchrun"):
        _build("sd3", dataclasses.replace(FLOW, parallel="ddp"))
