"""Structural tests of Reweight: the provisional backward in the rollout, the per-row backward graphs, and what
the plan chooses and refuses."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leancompile import backbones, optimize, passes
from leancompile.passes.meta import CALL, PARAMETER, PROVISIONAL, REWRITE, Provisional, Rewrite
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer
from leancompile.plan import Action, Schedule

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
    head = [n for n in nodes if n.meta.get(PROVISIONAL) is Provisional.LOSS]
    backward = [n for n in nodes if n.meta.get(PROVISIONAL) is Provisional.BACKWARD]
    assert head and backward and not any(CALL in n.meta for n in head)
    assert all(n.meta.get(REWRITE) is Rewrite.INSERTED for n in backward)
    assert any("backward" in str(n.target) for n in backward)  # e.g. the attention's backward kernel
    outputs = next(n for n in nodes if n.op == "output").args[0]
    grads = outputs[2:]
    assert len(grads) == len(trainer.trainable)
    assert [g.name for g in grads] == [f"provisional_grad_{i}" for i in range(len(grads))]
    assert all(g.meta[PROVISIONAL] is Provisional.GRADIENT for g in grads)
    assert [g.meta[PARAMETER] for g in grads] == trainer.trainable_names
    assert [tuple(g.meta["val"].shape) for g in grads] == [tuple(p.shape) for p in trainer.trainable]


@pytest.mark.parametrize("lora_rank", [2, None])
def test_the_kl_reference_runs_once_per_trained_sample_and_step_as_in_native(lora_rank):
    """Reweight evaluates the loss head twice in the rollout (``A = 1`` and ``A = 0``) and once more in the update;
    the reference forward runs in the first and the engine serves the others its kept values: LoRA's reference
    is the backbone with adapters disabled, full fine-tuning's a frozen copy with an engine of its own."""
    rows, kl = {}, {}
    for schedule in ("native", "reweight"):
        trainer = optimize(_trainer(beta=0.05, guidance_scale=2.0, lora_rank=lora_rank, dtype="float64",
                                    train_batch_size=2, gradient_accumulation_steps=2), schedule=schedule)
        rows[schedule] = 0
        if lora_rank is None:
            reference, counted = trainer.reference.model, lambda: True
        else:
            reference = trainer.backbone.model
            lora = next(m for m in reference.modules() if hasattr(m, "lora_A"))
            counted = lambda: lora.disable_adapters  # the reference: adapters disabled

        def count(module, args, kwargs):
            if counted():
                rows[schedule] += args[0].shape[0] if args else kwargs["hidden_states"].shape[0]

        handle = reference.register_forward_pre_hook(count, with_kwargs=True)
        stats = trainer.step([1, 2])
        handle.remove()
        kl[schedule] = float(stats["kl"])
        if schedule == "reweight":
            assert stats["served_calls"] > 0 and stats["recomputed_calls"] == 0
    assert rows["reweight"] == rows["native"] > 0
    assert kl["reweight"] == pytest.approx(kl["native"], rel=1e-10)


def test_a_loss_non_linear_in_the_advantages_refuses_reweight_and_says_why():
    plan = optimize(_trainer(SquaredAdvantageTrainer), "reweight").plan
    assert plan.schedule is Schedule.RETAIN and not plan.linearity.affine and "pow" in plan.linearity.reason
    [refusal] = plan.refusals
    assert refusal.schedule is Schedule.REWEIGHT and refusal.reason.startswith("the loss is not affine")
    assert plan.choice == f"{refusal} -> retain"


class SummedPenaltyTrainer(FlowGRPOTrainer):
    """Adds a term linear in A but summed over the micro-batch's rows (not averaged)."""

    def micro_step_loss(self, micro):
        loss, info = super().micro_step_loss(micro)
        return loss + 1e-3 * (micro.advantages * self.train_velocity(micro).mean(dim=(1, 2, 3))).sum(), info


def test_a_loss_summed_over_rows_refuses_reweight():
    plan = optimize(_trainer(SummedPenaltyTrainer), "reweight").plan
    assert plan.schedule is Schedule.RETAIN and plan.linearity.affine and not plan.linearity.row_mean
    assert [r.schedule for r in plan.refusals] == [Schedule.REWEIGHT]


@pytest.mark.parametrize("kw", [{}, {"beta": 0.05}, {"lora_rank": None, "sample_batch_size": 2}])
def test_auto_runs_the_planners_fastest_schedule_that_fits_and_says_why(kw):
    plan = optimize(_trainer(**kw)).plan
    cost = plan.cost
    fitting = [e for e in cost.estimates[:-1] if e.fits]
    assert cost["auto"].seconds == pytest.approx(min(e.seconds for e in fitting), rel=1e-9) or \
        cost["auto"].seconds < min(e.seconds for e in fitting)
    assert plan.schedule == cost["auto"].runs and "planned on cpu" in plan.choice
    assert all(a.kind in (plan.schedule, Action.NO_GRAD) for a in plan.steps)


def test_auto_turns_to_reweight_when_retaining_does_not_fit():
    free = optimize(_trainer(sample_batch_size=1)).plan.cost
    retain = free["retain"]
    # Room for the static memory, one call and Reweight's buffers, not for every retained activation.
    limit = free["reweight"].peak_bytes + (retain.peak_bytes - free["reweight"].peak_bytes) // 4
    plan = optimize(_trainer(sample_batch_size=1), memory_limit=limit).plan
    assert not plan.cost["retain"].fits and plan.cost["reweight"].fits
    assert plan.schedule == "reweight" and "reweight:" in plan.choice


def test_the_per_row_backward_keeps_a_gradient_row_per_row_and_retain_sums_them():
    """Reweight's traced backward returns every parameter's gradient with a leading row dimension; Retain's the
    sum over rows, in the parameter's own shape."""
    shapes = {}
    for schedule in ("reweight", "retain"):
        trainer = optimize(_trainer(lora_rank=2, train_batch_size=4), schedule=schedule)
        trainer.step([1, 2])
        gm = trainer.graphs["backbone_backward"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        shapes[schedule] = [tuple(o.meta["val"].shape) for o in outputs]
        assert len(outputs) == len(trainer.trainable)
    rows = {s[0] for s in shapes["reweight"]}
    assert len(rows) == 1 and [s[1:] for s in shapes["reweight"]] == shapes["retain"]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_served_calls_gradient_combines_exactly_the_rows_it_was_found_at(data):
    """However the served rows lie among the kept calls' rows (a shuffled micro-batch, a few rows far apart, rows of
    two kept calls), each parameter's gradient is the sum over the served rows and cotangents of the coefficient
    times that row's provisional gradient (kept whole, packed with the other small ones, or as factors; two kept
    calls' packs laid alike or not), in float64 to rounding, and no other kept row contributes."""
    from types import SimpleNamespace

    import torch

    from leancompile.runtime.reweight import ProvisionalRows, Reweight
    from leancompile.runtime.store import KeptCall, Match

    from leancompile.runtime.rowwise import Factors

    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shapes, k = [(3, 5), (7,), (2, 2, 2)], data.draw(st.integers(1, 2))
    randn = lambda *shape: torch.randn(shape, generator=generator, dtype=torch.float64)
    kept = []
    for _ in range(data.draw(st.integers(1, 2))):
        rows = data.draw(st.integers(1, 12))
        gradients = [tuple(randn(rows, *shape) for _ in range(k)) for shape in shapes]
        if kept and k == 2 and data.draw(st.booleans()):  # one head did not reach a parameter here: packed unlike
            gradients[1] = (None, *gradients[1][1:])
        # the (3, 5) weight's as factors over 1 or 2 tokens: the bases share the right side (a layer's input), the
        # left side, or neither
        tokens, shared = data.draw(st.integers(1, 2)), data.draw(st.sampled_from(["right", "left", "none"]))
        left, right = randn(rows, 3, tokens), randn(rows, tokens, 5)
        gradients.append(tuple(Factors(left if shared == "left" else randn(rows, 3, tokens),
                                       right if shared == "right" else randn(rows, tokens, 5)) for _ in range(k)))
        provisional = ProvisionalRows(None, gradients, torch.zeros(rows, dtype=torch.bool))
        reached = {i for i, g in enumerate(gradients) if not isinstance(g[0], (Factors, type(None)))}
        assert [pack.params for pack in provisional.packs] == [tuple(sorted(reached))]
        kept.append(KeptCall(None, (), (), rows=provisional))
    every = [(call, row) for call in kept for row in range(len(call.rows.used))]
    places = data.draw(st.permutations(every)).__getitem__(slice(0, data.draw(st.integers(1, len(every)))))
    coefficients = torch.randn((len(places), k), generator=generator, dtype=torch.float64)
    grads = Reweight().gradients(None, Match(tuple(places)), torch.zeros(len(places)),
                                 context=SimpleNamespace(values=coefficients))
    dense = lambda g, row: g.left[row] @ g.right[row] if isinstance(g, Factors) else 0 if g is None else g[row]
    for i, grad in enumerate(grads):
        expected = sum(coefficients[p, b] * dense(call.rows.gradients[i][b], row)
                       for p, (call, row) in enumerate(places) for b in range(k))
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
