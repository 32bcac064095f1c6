"""Structural tests of Reweight: the provisional backward in the rollout, the correction nodes, what the plan
chooses and refuses, and the clip bound behind the moment accumulators."""
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leancompile import backbones, optimize, passes
from leancompile.passes.meta import CALL, MATMUL_ORDER, PROVISIONAL, REWRITE
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer
from leancompile.trainers.advantages import group_advantages

from conftest import PromptTable, mean_reward
from test_passes import SquaredAdvantageTrainer


def _trainer(cls=FlowGRPOTrainer, family="sd3", **kw):
    backbone = backbones.tiny(family, seed=0)
    prompts = PromptTable(backbone)
    config = FlowGRPOConfig(**{"num_steps": 3, "group_size": 2, **kw})
    return cls(config, backbone, mean_reward, prompts, uncond=prompts.uncond if config.use_cfg else None)


def test_the_provisional_rollout_backpropagates_the_kept_call_once():
    trainer = _trainer(guidance_scale=2.0)
    gm = passes.capture_provisional(trainer)
    nodes = list(gm.graph.nodes)
    # one backbone forward (the doubled CFG batch): the loss head reads its output instead of calling again
    assert {n.meta[CALL].index for n in nodes if CALL in n.meta} == {0}
    head = [n for n in nodes if n.meta.get(PROVISIONAL) == "loss"]
    backward = [n for n in nodes if n.meta.get(PROVISIONAL) == "backward"]
    assert head and backward and not any(CALL in n.meta for n in head)
    assert all(n.meta.get(REWRITE) == "inserted" for n in backward)
    assert any("backward" in str(n.target) for n in backward)  # e.g. the attention's backward kernel
    outputs = next(n for n in nodes if n.op == "output").args[0]
    grads = outputs[2:]
    assert len(grads) == len(trainer.trainable)
    assert [g.name for g in grads] == [f"provisional_grad_{i}" for i in range(len(grads))]
    assert [g.meta[PROVISIONAL] for g in grads] == trainer.trainable_names
    assert [tuple(g.meta["val"].shape) for g in grads] == [tuple(p.shape) for p in trainer.trainable]


def test_the_kl_reference_runs_once_per_trained_sample_and_step_as_in_native():
    """Reweight evaluates the loss head twice in the rollout (``A = 1`` and ``A = 0``) and once more in the update;
    the reference forward runs in the first and the others read its velocity back."""
    rows, kl = {}, {}
    for schedule in ("native", "reweight"):
        trainer = optimize(_trainer(beta=0.05, guidance_scale=2.0, lora_rank=2, dtype="float64", train_batch_size=2,
                                    gradient_accumulation_steps=2), schedule=schedule)
        rows[schedule] = 0
        reference_model = trainer.reference_model

        @contextlib.contextmanager
        def counted():
            with reference_model() as model:
                def call(x, *args):
                    rows[schedule] += x.shape[0]
                    return model(x, *args)
                yield call

        trainer.reference_model = counted
        stats = trainer.step([1, 2])
        kl[schedule] = float(stats["kl"])
        if schedule == "reweight":
            assert stats["reused_micro_steps"] > 0 and stats["recomputed_micro_steps"] == 0
    assert rows["reweight"] == rows["native"] > 0
    assert kl["reweight"] == pytest.approx(kl["native"], rel=1e-10)


def test_per_row_split_computes_each_lora_weight_gradient_once():
    """The backward graph of a LoRA rollout call hands over every row's weight gradient, and the batch's
    gradient is the sum of those rows: one contraction per weight, no ``mm`` left beside the ``bmm``."""
    trainer = optimize(_trainer(lora_rank=2, group_size=3), schedule="reweight")
    trainer.step([1, 2])
    per_sample = trainer._runtime.per_sample
    assert per_sample.split, per_sample.refused
    nodes = list(per_sample.partitioned.backward_graph.graph.nodes)
    per_row = [n for n in nodes if n.name.startswith("per_row_grad_")]
    sums = [n for n in nodes if n.name.startswith("sum_of_rows_")]
    assert len(per_row) == len(sums) == len(trainer.trainable)
    # a product the device runs faster with its operands swapped is "reordered" (passes.matmul_order)
    assert all(n.meta[REWRITE] in ("inserted", "reordered") for n in per_row + sums)
    assert all(s.args[0] is b for s, b in zip(sums, per_row))
    # the inserted nodes carry shapes and strides, so the product-order pass timed every per-row product
    by_name = {n.name: n for n in nodes}
    products = [n if n.target is torch.ops.aten.bmm.default else by_name[f"swapped_{n.name}"] for n in per_row]
    assert all(MATMUL_ORDER in p.meta and "val" in n.meta for p, n in zip(products, per_row))
    # the weight gradients the graph returns come from those sums (through transposes), not from an ``mm``
    sources = []
    for node in next(n for n in nodes if n.op == "output").args[0]:
        while isinstance(node, torch.fx.Node) and str(node.target) == "aten.t.default":
            node = node.args[0]
        sources.append(node)
    assert set(sums) <= set(sources)
    assert not any(isinstance(n, torch.fx.Node) and str(n.target) == "aten.mm.default" for n in sources)


@pytest.mark.parametrize("beta, clip, mode, sums", [(0.0, 5.0, "accumulators", 1), (0.05, 0.5, "per-sample", 2)])
def test_correction_nodes_scale_and_sum_the_buffers(beta, clip, mode, sums):
    trainer = optimize(_trainer(beta=beta, adv_clip_max=clip, sample_batch_size=1, group_size=4,
                                train_batch_size=4), "reweight")
    with torch.no_grad():  # move the policy off its reference so the KL term has a gradient
        for p in trainer.trainable:
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    stats = trainer.step([1])
    assert stats["buffer_mode"] == mode
    gm = trainer.graphs["correction"]
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_function"]
    assert calls and all(n.meta.get(REWRITE) == "inserted" for n in calls)
    k = len(trainer.trainable)
    assert sum(n.name.startswith("sum_scaled_buffers_") for n in calls) == sums * k
    if mode == "accumulators":
        assert placeholders[:3] == ["group_scales", "group_mean_shifts", "group_weights"]
        assert sum(n.name.startswith("centre_on_group_mean_") for n in calls) == k
    else:
        assert placeholders[:2] == ["advantage_weights", "sample_weights"]
        assert sum(n.name.startswith("add_advantage_free_terms_") for n in calls) == k
    outputs = next(n for n in nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [tuple(p.shape) for p in trainer.trainable]


def test_a_loss_non_linear_in_the_advantages_refuses_reweight_and_says_why():
    plan = optimize(_trainer(SquaredAdvantageTrainer), "reweight").plan
    assert plan.schedule == "retain"
    assert plan.choice.startswith("Reweight refused: the loss is not affine in the advantages")
    assert "pow" in plan.choice and plan.choice.endswith("-> Retain")


class SummedPenaltyTrainer(FlowGRPOTrainer):
    """Adds a term linear in A but summed over the micro-batch's rows (not averaged)."""

    def micro_step_loss(self, micro):
        loss, info = super().micro_step_loss(micro)
        return loss + 1e-3 * (micro.advantages * self.train_velocity(micro).mean(dim=(1, 2, 3))).sum(), info


def test_a_loss_summed_over_rows_refuses_reweight():
    plan = optimize(_trainer(SummedPenaltyTrainer), "reweight").plan
    assert plan.schedule == "retain" and "sums over the micro-batch's rows" in plan.choice


@pytest.mark.parametrize("kw", [{}, {"beta": 0.05}, {"lora_rank": None, "sample_batch_size": 2}])
def test_auto_runs_the_planners_fastest_schedule_that_fits_and_says_why(kw):
    plan = optimize(_trainer(**kw)).plan
    cost = plan.cost
    fitting = [e for e in cost.estimates[:3] if e.fits]
    assert cost["auto"].seconds == pytest.approx(min(e.seconds for e in fitting), rel=1e-9) or \
        cost["auto"].seconds < min(e.seconds for e in fitting)
    assert plan.schedule == cost["auto"].runs and "planned on cpu" in plan.choice
    assert all(a.action in (plan.schedule, "no-grad") for a in plan.steps)


def test_auto_turns_to_reweight_when_retaining_does_not_fit():
    free = optimize(_trainer(sample_batch_size=1)).plan.cost
    retain = free["retain"]
    # Room for the static memory, one call and Reweight's buffers, not for every retained activation.
    limit = free["reweight"].peak_bytes + (retain.peak_bytes - free["reweight"].peak_bytes) // 4
    plan = optimize(_trainer(sample_batch_size=1), memory_limit=limit).plan
    assert not plan.cost["retain"].fits and plan.cost["reweight"].fits
    assert plan.schedule == "reweight" and "reweight:" in plan.choice


@pytest.mark.parametrize("unbiased", [False, True])
def test_the_clip_bound_is_reached_by_one_outlier(unbiased):
    for g in (2, 3, 5, 26, 27):
        rewards = torch.zeros(g, dtype=torch.float64)
        rewards[0] = 1.0
        largest = float(group_advantages(rewards, g, unbiased=unbiased, eps=0.0).abs().max())
        assert largest == pytest.approx(passes.max_abs_advantage(g, unbiased))
    assert passes.clip_never_binds(FlowGRPOConfig(group_size=26), 26)[0]
    assert not passes.clip_never_binds(FlowGRPOConfig(group_size=27), 27)[0]


@given(rewards=st.lists(st.floats(-1e3, 1e3), min_size=6, max_size=6), groups=st.sampled_from([1, 2, 3]),
       unbiased=st.booleans(), global_std=st.booleans())
@settings(max_examples=200, deadline=None)
def test_no_rewards_exceed_the_clip_bound(rewards, groups, unbiased, global_std):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    g = 6 // groups
    bound = passes.max_abs_advantage(g, unbiased, global_std, num_samples=6)
    adv = group_advantages(rewards, g, unbiased=unbiased, eps=1e-8, global_std=global_std)
    assert float(adv.abs().max()) <= bound * (1 + 1e-9)
