"""Retain per transformer block (``optimize(t, "retain", per_block=True)``, what FSDP2 runs: runtime.regional)
trains exactly what native trains, and serves a block only inside a verified backbone call."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leancompile import optimize
from leancompile.runtime.regional import RegionalEngine
from leancompile.runtime.reweight import last_blocks
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig

from conftest import check_served_calls, mark_optimizer_steps
from test_retain_equivalence import _build, grpo_configs
from test_reweight_equivalence import _run_both as _run_reweight, configurations as reweight_configurations


def _flat(trainer):
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


def _run_both(family, config, prompts=(1, 2), between=None):
    """Native's and the per-block program's weight updates over one step (``between(trainer)`` runs after each
    rollout, before its update)."""
    trainers = [_build(family, config), optimize(_build(family, config), schedule="retain", per_block=True)]
    start = _flat(trainers[0])
    stats = []
    for trainer in trainers:
        if between is not None:
            rollout = type(trainer).rollout
            trainer.rollout = lambda p, t=trainer, r=rollout: (r(t, p), between(t))[0]
        stats.append(trainer.step(list(prompts)))
    return trainers[1], stats, _flat(trainers[0]) - start, _flat(trainers[1]) - start


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


@given(family=st.sampled_from(["flux", "sd3", "wan"]), config=grpo_configs())
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_per_block_retain_equals_native_in_float64(family, config):
    native = _build(family, config)
    fast = optimize(_build(family, config), schedule="retain", per_block=True)
    assert isinstance(fast._engine, RegionalEngine)
    marks = mark_optimizer_steps(fast)
    start = _flat(native)
    n_stats, f_stats = native.step([1, 2]), fast.step([1, 2])
    assert n_stats["optimizer_steps"] == f_stats["optimizer_steps"]
    d_native, d_fast = _flat(native) - start, _flat(fast) - start
    if d_native.norm() > 0:
        assert _relative(d_fast, d_native) <= 1e-10
    else:
        assert float(d_fast.norm()) <= 1e-14
    check_served_calls(fast, marks, every_call_served=config.num_inner_epochs == 1)


def test_every_block_call_of_the_update_is_served_and_returns_its_inputs_gradient():
    """DanceGRPO-style: the rollout calls hold a group, the update one sample; with full fine-tuning the embeddings
    train too, so each block's served backward must hand its inputs' gradient back through the embeddings."""
    config = DanceGRPOConfig(num_steps=3, group_size=3, gradient_accumulation_steps=3, lora_rank=None,
                             dtype="float64", max_grad_norm=1.0)
    fast, (_, stats), d_native, d_fast = _run_both("flux", config, prompts=(1,))
    assert _relative(d_fast, d_native) <= 1e-10
    blocks = len(fast._engine.blocks)
    assert stats["recomputed_calls"] == 0 and stats["served_calls"] == blocks * stats["optimizer_steps"] * 3
    assert stats["retained_bytes"] > 0
    # Identical blocks (Flux's double blocks, its single blocks) share one compiled program each.
    programs = {id(engine.rowwise[1.0]._programs) for engine in fast._engine.engines}
    assert len(programs) == len(fast.backbone.block_stacks()) < len(fast._engine.engines)


def test_a_write_through_data_into_the_embeddings_recomputes_every_block():
    """Only the blocks' own weights are each block's state; a change of the embeddings' weights (here a write
    through .data, which moves no version counter) must still keep every block from being served."""
    config = FlowGRPOConfig(num_steps=2, group_size=2, train_batch_size=2, dtype="float64", timestep_fraction=1.0)

    def write(trainer):
        with torch.no_grad():
            trainer.backbone.model.pos_embed.proj.weight.data.mul_(1.01)

    fast, _, d_native, d_fast = _run_both("sd3", config, prompts=(1,), between=write)
    assert _relative(d_fast, d_native) <= 1e-10
    calls = [r for r in fast.last_calls if r.action in ("served", "recomputed")]
    assert calls and all(r.action == "recomputed" for r in calls)
    assert calls[0].kind == "written" and {r.kind for r in calls} <= {"written", "nothing kept"}


def test_a_second_optimizer_step_recomputes_its_blocks():
    config = FlowGRPOConfig(num_steps=3, group_size=4, train_batch_size=2, gradient_accumulation_steps=1,
                            dtype="float64", timestep_fraction=1.0)
    fast, (_, stats), d_native, d_fast = _run_both("sd3", config, prompts=(1,))
    assert stats["optimizer_steps"] == 2 and stats["served_calls"] == stats["recomputed_calls"] > 0
    assert _relative(d_fast, d_native) <= 1e-10


def test_gradient_checkpointing_and_cfg_as_one_doubled_call():
    config = FlowGRPOConfig(num_steps=2, group_size=2, train_batch_size=2, dtype="float64", guidance_scale=2.0,
                            beta=0.05, gradient_checkpointing=True)
    _, (_, stats), d_native, d_fast = _run_both("wan", config, prompts=(1, 2))
    assert _relative(d_fast, d_native) <= 1e-10 and stats["served_calls"] > 0


def test_per_block_arguments_are_checked():
    trainer = _build("sd3", dataclasses.replace(FlowGRPOConfig(num_steps=2, group_size=2), dtype="float64"))
    with pytest.raises(ValueError, match="per_block must be True, False or None"):
        optimize(trainer, per_block="yes")
    with pytest.raises(ValueError, match="it cannot serve bitwise=True"):
        optimize(trainer, bitwise=True, per_block=True)


@given(case=reweight_configurations(), family=st.sampled_from(["sd3", "flux", "wan"]))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_per_block_reweight_equals_native(case, family):
    """Reweight per block (what FSDP2 runs): each block's per-row gradients, combined with the coefficients the
    update's cotangent has at the backbone's output. SD3 without its float32 island to float64 rounding; Flux and
    Wan within float32 rounding, their islands (as the whole-call Reweight, see test_reweight_equivalence)."""
    config, prompts = case
    native, fast, _, (g_native, g_fast), (d_native, d_fast) = _run_reweight(family, config, prompts, per_block=True)
    assert isinstance(fast._engine, RegionalEngine) and fast.plan.schedule == "reweight"
    tolerance = 1e-10 if family == "sd3" else 1e-5
    assert bool(g_native) == bool(g_fast)
    if g_native:  # zero where every advantage is (a group of equal rewards) and no KL term: then zero too
        assert (_relative(g_fast[0], g_native[0]) <= tolerance if g_native[0].norm() > 0
                else float(g_fast[0].norm()) <= 1e-12)
    if d_native.norm() > 0:
        assert _relative(d_fast, d_native) <= tolerance


def test_a_step_retained_at_a_fraction_runs_each_block_at_that_budget():
    """``retain@0.25`` per block (what ``memory_budget=0.25`` and auto's partial steps run under FSDP2): every
    block keeps its partition's activations at that budget and recomputes the rest in its backward; every block
    call is still served, the weights follow native's, and less is kept."""
    config = DanceGRPOConfig(num_steps=3, group_size=2, gradient_accumulation_steps=2, dtype="float64",
                             timestep_fraction=1.0)
    native = _build("flux", config)
    fast = optimize(_build("flux", config), schedule="retain", per_block=True)
    partial = optimize(_build("flux", config), schedule="retain", per_block=True, memory_budget=0.25)
    assert "activation budget f" in partial.plan.choice
    assert {a.fraction for a in partial.plan.steps if a.keeps} == {0.25}
    start = _flat(native)
    native.step([1])
    stats = {name: trainer.step([1]) for name, trainer in (("whole", fast), ("partial", partial))}
    for trainer in (fast, partial):
        assert _relative(_flat(trainer) - start, _flat(native) - start) <= 1e-10
    assert stats["partial"]["served_calls"] == stats["whole"]["served_calls"] > 0
    assert stats["partial"]["recomputed_calls"] == stats["whole"]["recomputed_calls"]
    assert 0 < stats["partial"]["retained_bytes"] < stats["whole"]["retained_bytes"]
    assert all(set(engine.rowwise) == {0.25, 1.0} for engine in partial._engine.engines)

@pytest.mark.parametrize("lora_rank", [None, 4])
def test_reweight_of_the_last_blocks_recomputes_the_first_and_equals_native(lora_rank):
    """``reweight@0.5`` (what the planner chooses under FSDP2 where every block's per-sample gradients do not fit):
    the last blocks, half of the blocks' parameters, keep per-sample gradients; the heads run the first blocks
    without grad, and the update recomputes them natively under the served blocks' input gradients. With a KL
    term (two heads) and, under full fine-tuning, the embeddings training too."""
    config = FlowGRPOConfig(num_steps=3, group_size=2, train_batch_size=2, beta=0.05, lora_rank=lora_rank,
                            dtype="float64")
    native = _build("sd3", config)
    whole, part = (optimize(_build("sd3", config), schedule="reweight", per_block=True) for _ in range(2))
    part.plan = dataclasses.replace(part.plan, steps=tuple(
        dataclasses.replace(a, fraction=0.5) if a.keeps else a for a in part.plan.steps))
    start = _flat(native)
    native.step([1, 2])
    stats = {name: trainer.step([1, 2]) for name, trainer in (("whole", whole), ("part", part))}
    for trainer in (whole, part):
        assert _relative(_flat(trainer) - start, _flat(native) - start) <= 1e-10
    sizes = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in part._engine.blocks]
    engines, kept = len(part._engine.engines), last_blocks(sizes, 0.5)
    assert 0 < len(kept) < engines and kept[-1] == engines - 1
    # the first blocks' update calls recompute (nothing kept), the last ones' are served as under whole Reweight
    fewer = stats["whole"]["served_calls"] - stats["part"]["served_calls"]
    assert fewer > 0 and stats["part"]["recompute_reasons"]["nothing kept"] == \
        stats["whole"]["recompute_reasons"].get("nothing kept", 0) + fewer
    assert 0 < stats["part"]["buffer_bytes"] < stats["whole"]["buffer_bytes"]
