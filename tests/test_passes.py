"""Structural tests of each pass: what it finds, what it marks, what the rewrite inserts and removes."""
import functools

import pytest
import torch

from leancompile import backbones, optimize, passes
from leancompile.passes.shared import backbone_calls, call_boundary
from leancompile.passes.pipeline import apply
from leancompile.passes.meta import (CALL, INPUT, LINEARITY, MATMUL_ORDER, NEEDS_GRAD, PROVENANCE, REWRITE, SHARED,
                                     Linear, Rewrite)
from leancompile.passes.rewrite import RETAINED, REUSED
from leancompile.plan import Schedule
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig, FlowGRPOTrainer

from conftest import PromptTable, mean_reward


def _trainer(family="sd3", **kw):
    backbone = backbones.tiny(family, seed=0)
    prompts = PromptTable(backbone)
    config = FlowGRPOConfig(num_steps=3, group_size=2, **kw)
    return FlowGRPOTrainer(config, backbone, mean_reward, prompts, uncond=prompts.uncond if config.use_cfg else None)


@pytest.fixture(scope="module")
def cfg_kl_programs():
    trainer = _trainer(guidance_scale=2.0, cfg_detach_uncond=True, beta=0.05)
    return trainer, passes.capture(trainer)


@pytest.mark.fast
def test_capture_tags_placeholders_and_backbone_calls(cfg_kl_programs):
    trainer, programs = cfg_kl_programs
    roles = [n.meta[INPUT] for n in programs.update.graph.nodes if n.op == "placeholder"]
    assert roles[:len(trainer.trainable_names)] and all(r.startswith(("param:", "buffer:", "data:")) for r in roles)
    assert {f"param:{n}" for n, _ in trainer.backbone.named_parameters()} <= set(roles)
    rollout_calls = {n.meta[CALL] for n in programs.rollout.graph.nodes if CALL in n.meta}
    update_calls = {n.meta[CALL] for n in programs.update.graph.nodes if CALL in n.meta}
    assert [(c.grad_enabled, c.adapters_enabled) for c in rollout_calls] == [(False, True)]
    # the policy's re-forward (grad) and the KL reference (adapters disabled, no grad)
    assert sorted((c.index, c.grad_enabled, c.adapters_enabled) for c in update_calls) == [(0, True, True),
                                                                                         (1, False, False)]


@pytest.mark.fast
def test_detection_pairs_the_policy_call_and_maps_the_cfg_layout(cfg_kl_programs):
    trainer, programs = cfg_kl_programs
    shared = passes.detect_shared_backbone(programs.rollout, programs.update)
    assert shared.pairs == ((0, 0),)
    assert shared.layout.segments == 2  # [uncond, cond]
    assert all("latents" in s for s in shared.layout.sources)
    assert set(shared.parameters) >= {n for n in trainer.trainable_names}  # the LoRA weights are read
    assert [i for i, _ in shared.unshared] == [1] and "without grad" in shared.unshared[0][1]
    policy = backbone_calls(programs.update)[0]
    assert sum(SHARED in n.meta for n in policy) == shared.nodes > 0.9 * len(policy)
    inputs, _ = call_boundary(policy)
    assert any(PROVENANCE in n.meta for n in inputs)


@pytest.mark.fast
def test_detection_refuses_an_update_that_sees_different_inputs():
    trainer = _trainer(guidance_scale=2.0, train_cfg=False)  # rollout doubles the batch, the update does not
    programs = passes.capture(trainer)
    shared = passes.detect_shared_backbone(programs.rollout, programs.update)
    assert not shared.found and "inputs differ" in shared.unshared[0][1]
    plan = optimize(trainer, schedule="auto").plan
    assert plan.schedule == "native" and "inputs differ" in plan.steps[0].reason


@pytest.mark.fast
def test_gradient_pruning_drops_the_detached_uncond_branch(cfg_kl_programs):
    _, programs = cfg_kl_programs
    need = passes.prune_gradient_need(programs.update, 0, 2)
    assert need.needed == (1,) and need.pruned == (0,)
    _, outputs = call_boundary(backbone_calls(programs.update)[0])
    assert outputs[0].meta[NEEDS_GRAD] == (1,)
    attached = passes.capture(_trainer(guidance_scale=2.0))
    assert passes.prune_gradient_need(attached.update, 0, 2).needed == (0, 1)


def test_pruning_halves_the_retained_bytes():
    def retained(detach):
        trainer = optimize(_trainer(guidance_scale=2.0, cfg_detach_uncond=detach, train_batch_size=4), "retain")
        return trainer.step([1, 2])["retained_bytes"]

    full, pruned = retained(False), retained(True)
    assert 0.4 * full <= pruned <= 0.6 * full


@pytest.mark.fast
def test_validity_refuses_dropout():
    trainer = _trainer()
    for module in trainer.backbone.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    for module in trainer.backbone.modules():
        if hasattr(module, "dropout") and isinstance(getattr(module, "dropout"), float):
            module.dropout = 0.1
    trainer.backbone.train()
    programs = passes.capture(trainer)
    validity = passes.check_validity(programs.rollout, programs.update, (0, 0))
    assert not validity.reusable and any(f.kind == "rng" for f in validity.findings)
    plan = optimize(trainer, schedule="retain").plan
    assert plan.schedule == "native" and "random" in plan.steps[0].reason


@pytest.mark.fast
def test_rewrite_inserts_the_retained_output_and_removes_the_update_backbone(cfg_kl_programs):
    _, programs = cfg_kl_programs
    rewritten = passes.rewrite_for_retain(programs.rollout, programs.update, (0, 0))
    r_nodes = {n.name: n for n in rewritten.rollout.graph.nodes}
    assert r_nodes[RETAINED].meta[REWRITE] is Rewrite.INSERTED
    output = next(n for n in rewritten.rollout.graph.nodes if n.op == "output")
    assert r_nodes[RETAINED] in output.all_input_nodes
    u_nodes = {n.name: n for n in rewritten.update.graph.nodes}
    assert u_nodes[REUSED].op == "placeholder" and u_nodes[REUSED].meta[REWRITE] is Rewrite.REUSED
    policy_left = [n for n in rewritten.update.graph.nodes if CALL in n.meta and n.meta[CALL].index == 0]
    reference_left = [n for n in rewritten.update.graph.nodes if CALL in n.meta and n.meta[CALL].index == 1]
    assert not policy_left and reference_left  # the reference forward stays
    assert len(rewritten.removed) >= len(backbone_calls(programs.update)[0])


@pytest.mark.fast
def test_optimize_errors_name_the_parameter():
    trainer = _trainer()
    with pytest.raises(ValueError, match="schedule must be one of"):
        optimize(trainer, schedule="fast")
    with pytest.raises(ValueError, match=r"memory_budget must be a fraction in \[0, 1\]"):
        optimize(trainer, schedule="retain", memory_budget=2.0)
    with pytest.raises(ValueError, match="tune_matmuls must be True or False"):
        optimize(trainer, tune_matmuls="yes")
    with pytest.raises(TypeError, match="missing: .*rollout_velocity"):
        optimize(object(), schedule="retain")


def test_native_schedule_runs_the_untransformed_program():
    native = optimize(_trainer(), schedule="native")
    assert native.plan.schedule == "native" and native._engine is None
    stats = native.step([1])
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] == 0 and stats["stopped"] is None


@pytest.mark.parametrize("schedule, action, marks", [
    ("retain", "retain", ("reused_backbone_out_from_rollout", "retain_backbone_out_for_update")),
    ("reweight", "reweight", ("provisional_grad_", "choice:          schedule='reweight' requested")),
])
def test_dancegrpo_plan_and_explain(schedule, action, marks):
    backbone = backbones.tiny("wan", seed=0)
    prompts = PromptTable(backbone)
    from leancompile.trainers import DanceGRPOTrainer
    trainer = optimize(DanceGRPOTrainer(DanceGRPOConfig(num_steps=4, group_size=2), backbone, mean_reward, prompts),
                       schedule)
    assert trainer.plan.schedule == action
    assert [a.label for a in trainer.plan.steps] == [action] * 4
    text = trainer.explain()
    assert all(mark in text for mark in marks)


class RoundingRolloutTrainer(FlowGRPOTrainer):
    """Like the originals that cast to fp16 before the transformer in the rollout only."""

    def rollout_velocity(self, step, rows, x, sigma, cond):
        return super().rollout_velocity(step, rows, x.to(torch.bfloat16).to(x.dtype), sigma, cond)


def _rounding_trainer():
    backbone = backbones.tiny("sd3", seed=0)
    prompts = PromptTable(backbone)
    return RoundingRolloutTrainer(FlowGRPOConfig(num_steps=3, group_size=2), backbone, mean_reward, prompts)


def test_cast_differences_are_a_numerics_finding_and_the_engine_recomputes_them():
    """The traces match modulo a cast (a finding); at run time the update's inputs are not the rollout's bits, so
    every call recomputes natively: reuse never trades the native gradient for speed."""
    lenient = optimize(_rounding_trainer(), schedule="retain")
    assert lenient.plan.schedule == "retain"
    assert any(f.kind == "numerics" and not f.refuses and "cast" in f.message for f in lenient.plan.findings)
    stats = lenient.step([1, 2])
    assert stats["served_calls"] == 0 and "inputs" in stats["recompute_reasons"]
    assert set(stats["recompute_reasons"]) <= {"inputs", "weights", "nothing kept"}
    strict = optimize(_rounding_trainer(), schedule="retain", strict=True)
    assert strict.plan.schedule == "native" and "cast" in strict.plan.steps[0].reason


def test_a_lower_memory_budget_keeps_fewer_activations_and_the_same_gradient():
    def run(budget):
        trainer = optimize(_trainer(dtype="float64", train_batch_size=4), "retain", memory_budget=budget)
        stats = trainer.step([1, 2])
        return stats["retained_bytes"], torch.cat([p.detach().flatten() for p in trainer.trainable])

    full_bytes, full_weights = run(None)
    low_bytes, low_weights = run(0.0)  # the one-row partition of these tiny models ignores budgets above 0
    assert low_bytes < full_bytes
    torch.testing.assert_close(low_weights, full_weights, rtol=1e-10, atol=1e-12)


def test_weights_modified_after_the_rollout_are_caught_and_recomputed():
    trainer = optimize(_trainer(dtype="float64", train_batch_size=4), "retain")
    rollout = trainer.rollout

    def rollout_then_touch(prompts):
        result = rollout(prompts)
        with torch.no_grad():
            trainer.trainable[0].mul_(1.0)  # same values, new version: reuse can no longer be proven
        return result

    trainer.rollout = rollout_then_touch
    stats = trainer.step([1, 2])
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] > 0
    assert set(stats["recompute_reasons"]) <= {"weights", "nothing kept"} and "weights" in stats["recompute_reasons"]


@pytest.mark.fast
def test_linearity_proves_the_ppo_loss_affine_and_separates_the_kl_term(cfg_kl_programs):
    _, programs = cfg_kl_programs
    linearity = passes.check_linearity(programs.update)
    assert linearity.affine and linearity.reason is None
    assert len(linearity.ties) == 1 and linearity.ties[0].startswith("maximum")
    assert len(linearity.advantage_free) == 1  # beta * KL
    free = next(n for n in programs.update.graph.nodes if n.name == linearity.advantage_free[0])
    assert free.meta.get(LINEARITY) is None
    assert {n.meta[LINEARITY] for n in programs.update.graph.nodes if LINEARITY in n.meta} == {Linear.AFFINE, Linear.TIE}
    assert passes.check_linearity(passes.capture(_trainer()).update).advantage_free == ()


class SquaredAdvantageTrainer(FlowGRPOTrainer):
    def micro_step_loss(self, micro):
        loss, info = super().micro_step_loss(micro)
        return loss + (micro.advantages ** 2).mean(), info


@pytest.mark.fast
def test_linearity_refuses_a_loss_non_linear_in_the_advantages():
    backbone = backbones.tiny("sd3", seed=0)
    trainer = SquaredAdvantageTrainer(FlowGRPOConfig(num_steps=3, group_size=2), backbone, mean_reward,
                                      PromptTable(backbone))
    linearity = passes.check_linearity(passes.capture(trainer).update)
    assert not linearity.affine and "pow" in linearity.reason
    plan = optimize(trainer, "retain").plan
    assert plan.schedule == "retain" and not plan.linearity.affine and "pow" in plan.linearity.reason
    assert [r.schedule for r in plan.refusals] == [Schedule.REWEIGHT]


@pytest.mark.fast
def test_scatters_into_fresh_buffers_are_written_in_place():
    """Functionalization turns ``out[..., 0::2] = a`` into whole-buffer scatters; the pass writes the slices in
    place where nothing else reads the buffer, and leaves a scatter whose input is read elsewhere alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.inplace import write_scatters_in_place

    def halves(x):  # Wan's rotary embedding
        out = torch.empty_like(x)
        out[..., 0::2] = x[..., 1::2] * 2
        out[..., 1::2] = x[..., 0::2] - 1
        return out * x

    def read_between(x):
        out = torch.zeros_like(x)
        out[..., 0::2] = x[..., 0::2]
        first = out * 3  # reads the buffer between the writes: the second write must not clobber it
        out[..., 1::2] = 1.0
        return first, out

    x = torch.randn(3, 8, dtype=torch.float64)
    for fn, expected in ((halves, 2), (read_between, 1)):
        gm = make_fx(torch.func.functionalize(fn))(x)
        scatters = lambda: sum(n.target is torch.ops.aten.slice_scatter.default for n in gm.graph.nodes)
        assert scatters() == 2
        assert apply(write_scatters_in_place, gm) == expected and scatters() == 2 - expected
        for got, want in zip(torch.utils._pytree.tree_leaves(gm(x)), torch.utils._pytree.tree_leaves(fn(x))):
            assert torch.equal(got, want)
        assert all(n.meta[REWRITE] is Rewrite.IN_PLACE for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default)


@pytest.mark.fast
def test_matrix_products_take_the_operand_order_their_timing_chose():
    """A product timed faster with its operands swapped becomes ``(B^T A^T)^T`` copied back into its layout,
    keeping its name; one timed slower stays as written; values are equal either way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.matmul_order import ProductTiming, order_matrix_products, time_product

    def lora_gradients(d, h, x):  # a weight gradient written the way autograd writes it, and a batched one
        return d.t() @ h, torch.bmm(x.transpose(1, 2), h.view(2, 3, 4))

    d, h, x = (torch.randn(*shape, dtype=torch.float64) for shape in ((6, 5), (6, 4), (2, 3, 5)))
    gm = make_fx(lora_gradients, tracing_mode="fake")(d, h, x)
    expected = gm(d, h, x)
    products = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    names = [n.name for n in products]
    timings = {"mm": ProductTiming(written=1.0, swapped=0.5), "bmm": ProductTiming(written=1.0, swapped=0.95)}
    timed = functools.partial(order_matrix_products, margin=0.1, timer=lambda n: timings[n.target._opname])
    assert apply(timed, gm) == 1
    nodes = {n.name: n for n in gm.graph.nodes}
    swapped = nodes[f"swapped_{names[0]}"]
    # mm(t(d), h) -> clone(t(mm(t(h), d))): the transpose of t(d) is d itself
    d_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert swapped.args[0].target is torch.ops.aten.t.default and swapped.args[1] is d_node
    assert nodes[names[0]].target is torch.ops.aten.clone.default
    assert nodes[names[0]].meta[REWRITE] == swapped.meta[REWRITE] is Rewrite.REORDERED
    assert nodes[names[1]].target is torch.ops.aten.bmm.default  # 5% faster is inside the margin
    assert swapped.meta[MATMUL_ORDER] == timings["mm"] and nodes[names[1]].meta[MATMUL_ORDER] == timings["bmm"]
    for got, want in zip(gm(d, h, x), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.stride() == want.stride()
    both = make_fx(lora_gradients, tracing_mode="fake")(d, h, x)
    assert apply(functools.partial(order_matrix_products, timer=lambda n: ProductTiming(written=1.0, swapped=0.1)),
                 both) == 2
    for got, want in zip(both(d, h, x), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.stride() == want.stride()
    # the timer itself runs both orders on the graph's device and caches per signature
    timing = time_product(products[1])
    assert 0 < timing.written < 1 and 0 < timing.swapped < 1 and time_product(products[1]) is timing


@pytest.mark.fast
def test_multiplications_by_one_are_dropped_where_they_return_their_input():
    """``x * 1.0`` (peft's LoRA scaling at ``lora_alpha = r``) goes; a product by one that promotes, changes the
    layout or is a graph output stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.identities import drop_multiplications_by_one

    def scaled(x, row, ints):
        lora = (x * 1.0).exp() + row * 1.0  # both dropped
        # kept: a promotion, a strided input (the product is dense), a graph output
        return lora, ints * 1.0, (x[:, ::2] * 1).exp(), x * 1.0

    x, row, ints = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64), torch.arange(4)
    gm = make_fx(scaled, tracing_mode="fake")(x, row, ints)
    multiplications = lambda: sum(n.target is torch.ops.aten.mul.Tensor for n in gm.graph.nodes)
    before = multiplications()
    assert apply(drop_multiplications_by_one, gm) == 2 and multiplications() == before - 2
    for got, want in zip(gm(x, row, ints), scaled(x, row, ints)):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.stride() == want.stride()


@pytest.mark.fast
def test_copies_of_values_nothing_else_reads_are_dropped():
    """``clone`` (dropout at ``p = 0`` in training mode) of an intermediate only it reads goes; a copy of an input,
    of a view, of a value read elsewhere, of an in-place result, or one that changes the layout stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.identities import drop_copies_of_unshared_values

    def copies(x, y):
        dropped = x.exp().clone() + x.sin().clone(memory_format=torch.contiguous_format)  # both dropped
        shared = y.exp()
        written = y.cos()
        written.add_(1)
        kept = (x.clone(), x.t().clone(), shared.clone() + shared, written.clone(),
                x.cos().t().clone(memory_format=torch.contiguous_format))
        return dropped, *kept

    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    gm = make_fx(copies)(x, y)
    clones = lambda: sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)
    before = clones()
    assert apply(drop_copies_of_unshared_values, gm) == 2 and clones() == before - 2
    for got, want in zip(gm(x, y), copies(x, y)):
        assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.fast
def test_views_of_views_fold_and_views_that_change_nothing_go():
    """A reshape chain becomes one reshape of its origin, permutations compose, and a view, expand or permutation
    that returns its input as it is goes; values, shapes and strides of every output stay, and in a graph that
    writes in place reshape chains stay as written."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.identities import fold_views

    def views(x, y):
        chain = x.exp().view(2, 6, 4).view(12, 4).reshape(3, 16) * 2  # one reshape of exp
        same = x.sin().view(3, 4, 4).expand(3, 4, 4).permute(0, 1, 2) + 1  # view, expand and permute go
        back = x.cos().transpose(1, 2).transpose(1, 2)  # an output: the cosine itself
        strided = y.t().reshape(12).view(3, 4)  # the transpose is copied by the one reshape left
        return chain, same, back, strided, x.view(48)  # an input's view as an output stays

    x, y = torch.randn(3, 4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    gm = make_fx(views, tracing_mode="fake")(x, y)
    before = len(gm.graph.nodes)
    removed = apply(fold_views, gm)
    assert removed == before - len(gm.graph.nodes) >= 7
    exp = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.exp.default)
    assert [u.target for u in exp.users] == [torch.ops.aten.reshape.default]
    assert not any(n.target in (torch.ops.aten.expand.default, torch.ops.aten.permute.default,
                                torch.ops.aten.transpose.int) for n in gm.graph.nodes)
    for got, want in zip(gm(x, y), views(x, y)):
        assert torch.equal(got, want) and got.shape == want.shape and got.stride() == want.stride()

    def written(x):
        buffer = x.exp().view(48).view(3, 16)
        buffer.mul_(2)
        return buffer

    gm = make_fx(written)(x)
    apply(fold_views, gm)
    assert sum(n.target is torch.ops.aten.view.default for n in gm.graph.nodes) == 2
    assert torch.equal(gm(x), written(x))


@pytest.mark.parametrize("tune", [True, False])
def test_tune_matmuls_decides_whether_the_compiled_products_are_timed(tune):
    """Every product of the compiled backward carries its timing when tuned; untuned, they run as traced. The forward's
    products are never reordered: a kept call returns eager's bits."""
    trainer = optimize(_trainer(lora_rank=2), "retain", tune_matmuls=tune)
    trainer.step([1, 2])
    products = {name: [n for n in trainer.graphs[name].graph.nodes
                       if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
                for name in ("backbone_forward", "backbone_backward")}
    assert products["backbone_backward"]
    assert all((MATMUL_ORDER in n.meta) == tune for n in products["backbone_backward"])
    assert not any(MATMUL_ORDER in n.meta for n in products["backbone_forward"])
    assert tune or not any(n.meta.get(REWRITE) == "reordered" for name in ("backbone_forward", "backbone_backward")
                           for n in trainer.graphs[name].graph.nodes)
