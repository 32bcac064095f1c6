"""The cost model and planner: devices, profiles on fake tensors, predictions against measurements on tiny CPU
configurations, the budget, and ``leancompile plan``."""
import dataclasses
import json

import pytest
import torch

from benchmarks.measure import interleaved_times, paired_speedup
from leancompile import backbones, optimize
from leancompile.cli import main as cli
from leancompile.cost import DEVICES, get_device, live_device, plan, profile_call, trainer_scenario
from leancompile.cost.planner import format_bytes, reweight_sample_limit
from saved_memory import LiveSavedTensors, static_bytes
from leancompile.cost.scenario import reweight_buffers
from leancompile.cost.profile import _fake_copy, _fake_inputs, _measure_call, _recording_blocks
from leancompile.cost.saved import block_saved_bytes
from leancompile.cost.workload import FlopCounter
from leancompile.trainers import DanceGRPOConfig, FlowGRPOConfig
from leancompile.plan import Action
from leancompile.schedules import SCHEDULES, estimators

from conftest import PromptTable, mean_reward

PROMPTS = [1, 2]


def _trainer(config, family="flux", **sizes):
    from leancompile.trainers import trainer_class

    backbone = backbones.tiny(family, seed=0, **sizes)
    prompts = PromptTable(backbone)
    cls = trainer_class(config.algorithm)
    return cls(config, backbone, mean_reward, prompts, uncond=prompts.uncond if config.use_cfg else None)


def _cost(trainer, limit=None, samples=None):
    cfg = trainer.config
    samples = samples or len(PROMPTS) * cfg.group_size
    s = trainer_scenario(trainer, samples, buffers=reweight_buffers(cfg, False, samples))
    return plan(s, live_device("cpu"), limit, estimators=estimators())


def test_the_registry_lists_the_vendor_figures_and_the_live_cpu():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "rtx-a6000", "l40s", "rtx-4090", "b200-180gb"):
        d = DEVICES[name]
        assert d.memory >= 24 * 2 ** 30 and d.bandwidth > 5e11 and d.host_link > 0 and d.source.startswith("NVIDIA")
        assert d.peak_flops(torch.bfloat16) > d.peak_flops(torch.float32)
    cpu = live_device("cpu")
    assert 0 < cpu.free <= cpu.memory and cpu.host_link is None and cpu.peak_flops(torch.float64) > 0
    with pytest.raises(ValueError, match="gpu: unknown device 'h1000'"):
        get_device("h1000")


@pytest.mark.parametrize("family, depth", [("flux", dict(num_layers=3, num_single_layers=4)),
                                           ("sd3", dict(num_layers=5, dual_attention_layers=(0, 1))),
                                           ("wan", dict(num_layers=5))])
def test_profiles_multiply_out_block_kinds_exactly(family, depth):
    backbone = backbones.tiny(family, **depth).requires_grad_(True)
    extrapolated = profile_call(backbone)
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(backbone, mode, "cpu")
    whole = _measure_call(fake, _fake_inputs(fake, 1, mode), mode)
    assert extrapolated.retained_bytes == whole.retained > 0
    assert extrapolated.forward == whole.forward and extrapolated.backward == whole.backward
    assert extrapolated.checkpoint_bytes == whole.checkpoint
    assert extrapolated.block_retained_bytes == whole.per_block > 0
    # Each block's partition at a partial budget (Retain per block at retain@f), one block of each kind multiplied
    # out, against every block of the whole model partitioned at that budget
    with _recording_blocks(fake) as calls, mode:
        fake(*_fake_inputs(fake, 1, mode))
    with mode:
        at_zero = sum(block_saved_bytes(block, a, kw, 0.0, fake.spec.block_shared) for block, a, kw in calls)
    assert extrapolated.retained_at(0.0, per_block=True) == at_zero
    assert 0 < at_zero < extrapolated.retained_at(1.0, per_block=True) == whole.per_block


@pytest.mark.parametrize("family, config", [
    ("flux", FlowGRPOConfig(num_steps=4, group_size=2, train_batch_size=2, gradient_accumulation_steps=2)),
    ("sd3", FlowGRPOConfig(num_steps=3, group_size=2, guidance_scale=2.0, lora_rank=None)),
    ("wan", DanceGRPOConfig(num_steps=5, group_size=2, gradient_accumulation_steps=4)),
])
def test_predicted_retained_and_buffer_bytes_are_within_ten_percent_of_measured(family, config):
    cost = _cost(_trainer(config, family))
    retained = optimize(_trainer(config, family), "retain").step(PROMPTS)["retained_bytes"]
    predicted = dict(cost["retain"].components)["retained activations"]
    assert abs(predicted - retained) <= 0.1 * retained
    stats = optimize(_trainer(config, family), "reweight").step(PROMPTS)
    # What the engine holds at its peak: the buffers, and a kept call's activations until its step's buffers are made
    components = dict(cost["reweight"].components)
    predicted = sum(components[k] for k in ("gradient buffers", "provisional cotangents", "activations (kept call)"))
    assert abs(predicted - stats["buffer_bytes"]) <= 0.1 * stats["buffer_bytes"], (components, stats["buffer_bytes"])


# Since the per-row forward keeps eager's kernels (passes.eager_bits), the profile's partition of Flux's single-stream
# block keeps 3072 bytes a row more than the runtime's (67584 against 64512 at budget 1, 15104 against 12032 at
# 0.25): 3% over in all at budget 1, 11.6% at 0.25. Strict: the test fails once the profile prices it again.
@pytest.mark.parametrize("budget", [1.0, pytest.param(0.25, marks=pytest.mark.xfail(
    strict=True, reason="the profile over-prices Flux's single-stream block per row by 3072 bytes (11.6% at 0.25)"))])
def test_per_block_retained_bytes_at_a_budget_are_within_ten_percent_of_measured(budget):
    """Retain per block (runtime.regional) at activation budget f keeps what each block's own partition saves at
    f, as the profile prices it (one block of each kind, here Flux's double and single blocks, multiplied out)."""
    config = FlowGRPOConfig(num_steps=4, group_size=2, train_batch_size=2, gradient_accumulation_steps=2)
    trainer = _trainer(config, num_layers=2, num_single_layers=3)
    scenario = dataclasses.replace(trainer_scenario(trainer, len(PROMPTS) * config.group_size), world_size=2,
                                   sharding="fsdp")
    cost = plan(scenario, live_device("cpu"), estimators=estimators())
    profile = scenario.profile
    predicted = dict(cost["retain"].components)["retained activations"] * (
        profile.retained_at(budget, per_block=True) / profile.retained_at(1.0, per_block=True))
    fast = optimize(_trainer(config, num_layers=2, num_single_layers=3), "retain", per_block=True,
                    memory_budget=budget)
    retained = fast.step(PROMPTS)["retained_bytes"]
    assert abs(predicted - retained) <= 0.1 * retained, (predicted, retained)


def _interleaved_times(programs, repetitions):
    """Each program's step timings (wall and CPU), round-robin after a warm-up step each; the checks read CPU
    time: on one thread it is the wall time without other load."""
    for trainer in programs.values():
        trainer.step(PROMPTS)  # compiles partitions, warms caches
    return interleaved_times(programs, PROMPTS, repetitions)[0]


@pytest.mark.timing
def test_predicted_speedup_is_within_fifteen_percent_of_measured():
    config = FlowGRPOConfig(num_steps=6, timestep_fraction=0.99, group_size=2, train_batch_size=2,
                            gradient_accumulation_steps=2)
    # The benchmark's Flux size: at smaller widths the per-operator cost of autograd dominates and the model, which
    # charges every operator one launch cost, underestimates what removing the forward saves.
    sizes = dict(attention_head_dim=64, num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 28, 28),
                 num_layers=1, num_single_layers=1, height=16, width=16, text_len=16)
    cost = _cost(_trainer(config, **sizes))
    # The roofline prices the eager operators in every program: it does not see what the products' operand order
    # gains in the compiled graphs, so they run as traced here.
    times = _interleaved_times({s: optimize(_trainer(config, **sizes), s, tune_matmuls=False)
                                for s in ("native", "retain")}, 5)
    measured = paired_speedup(times["native"], times["retain"], "cpu")
    assert abs(cost.speedup("retain") - measured) <= 0.15 * measured, (cost.speedup("retain"), measured)


_BUDGET_CONFIG = FlowGRPOConfig(num_steps=6, timestep_fraction=0.99, group_size=2, train_batch_size=2,
                                gradient_accumulation_steps=2, lora_rank=None, sample_batch_size=2)


def test_under_a_budget_that_cannot_retain_every_step_auto_fits():
    config = _BUDGET_CONFIG
    free = optimize(_trainer(config), samples_per_step=4).plan.cost
    native, retain = free["native"], free["retain"]
    limit = native.peak_bytes + (retain.peak_bytes - native.peak_bytes) // 2
    auto = optimize(_trainer(config), memory_limit=limit, samples_per_step=4)
    cost = auto.plan.cost
    assert not cost["retain"].fits and cost["auto"].fits and cost["auto"].peak_bytes <= limit
    assert auto.plan.schedule == cost["auto"].runs
    # The plan's trained steps take the planner's actions as they are (kind and fraction, values, not strings).
    trained = [a for a in auto.plan.steps if a.kind is not Action.NO_GRAD]
    assert [(a.kind, a.fraction) for a in trained] == [(a.kind, a.fraction) for a in cost["auto"].steps]
    assert any(a.kind is Action.RECOMPUTE or a.fraction < 1 for a in trained)
    # Measured: the peak of what autograd holds, plus what the engine keeps outside it (Retain's saved tensors,
    # Reweight's provisional gradients), plus the static memory.
    tracker = LiveSavedTensors.of(auto)
    with tracker.tracking():
        stats = auto.step(PROMPTS)
    held = stats["buffer_bytes"] + stats["retained_bytes"]
    assert static_bytes(auto) + tracker.peak + held <= limit


def test_under_fsdp_retain_and_reweight_run_per_block_and_hold_no_gathered_weights():
    """Under FSDP2 Retain and Reweight run per block (runtime.regional) and hold what native holds besides their
    activations or gradient buffers (each rank's per-sample gradients are whole, unreduced, and each buffer's row
    keeps its block cotangents and input gradients); native stays sharded."""
    trainer = _trainer(FlowGRPOConfig(num_steps=3, group_size=2, train_batch_size=4, lora_rank=None))
    scenario = dataclasses.replace(trainer_scenario(trainer, 4), world_size=8, sharding="fsdp")
    cost = plan(scenario, get_device("a100-80gb"), estimators=estimators())
    whole = sum(p.numel() * p.element_size() for p in trainer.trainable) * 2  # weights and gradients, all trained
    components = {name: dict(cost[name].components) for name in ("native", "retain", "reweight")}
    assert not any("gathered (FSDP2)" in components[name] for name in ("native", "retain", "reweight"))
    assert components["reweight"]["block input gradients"] > 0
    for name in ("retain", "reweight"):
        assert components[name]["weights"] == components["native"]["weights"] == whole // 2 // 8
    assert components["reweight"]["gradient buffers"] == 4 * whole // 2  # per-sample gradients are whole
    # Exchanging shards would hold the same bytes per rank and move 7/8 of them: the plan prices both, keeps whole
    layouts = dict(cost.limits)["Reweight's per-sample gradients (FSDP2)"]
    held = format_bytes(components["reweight"]["gradient buffers"])
    assert layouts.count(held) == 2 and format_bytes(4 * whole // 2 * 7 // 8) in layouts
    assert layouts.endswith("kept whole")
    assert cost["auto"].runs == "retain" and cost["auto"].note.endswith("(per block)")
    # Where every block's per-sample gradients do not fit, those of the last blocks that fit (the plan says so)
    budget = (cost["reweight"].peak_bytes + cost["native"].peak_bytes) // 2
    part = plan(scenario, get_device("a100-80gb"), budget, estimators=estimators())
    fraction = part["reweight"].steps[0].fraction
    assert part["reweight"].fits and 0.05 <= fraction < 1 and part["reweight"].seconds > cost["reweight"].seconds
    assert dict(part["reweight"].components)["gradient buffers"] < components["reweight"]["gradient buffers"]
    layouts = dict(part.limits)["Reweight's per-sample gradients (FSDP2)"]
    assert layouts.endswith(f"kept whole for the last {fraction:.0%}")
    # Where not even one step fits whole (and nothing can be offloaded), a step keeps each block's partition at a
    # partial budget, per block
    step = dict(cost["retain"].components)["retained activations"] // 3
    tight = plan(scenario, dataclasses.replace(get_device("a100-80gb"), host_link=None),
                 cost["native"].peak_bytes + step // 2, estimators=estimators())
    partial = [a for a in tight["auto"].steps if a.kind is Action.RETAIN]
    assert tight["auto"].per_block and partial and all(0 < a.fraction < 1 for a in partial), tight["auto"]
    # Ranks that draw their own trained steps would run Reweight's heads through FSDP2's per-block collectives at
    # different steps: there it runs on the gathered weights
    random = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, trained_steps="random"))
    components = dict(plan(random, get_device("a100-80gb"), estimators=estimators())["reweight"].components)
    assert components["gathered (FSDP2)"] == whole - whole // 8 and "block input gradients" not in components


def test_the_solved_reweight_boundary_is_where_reweight_stops_fitting():
    config = FlowGRPOConfig(num_steps=3, group_size=2, train_batch_size=2, sample_batch_size=1,
                            gradient_accumulation_steps=8, lora_rank=None, beta=0.04)
    trainer = _trainer(config)

    def cost(samples, budget):
        s = trainer_scenario(trainer, samples, advantage_free=True, buffers=reweight_buffers(config, True, samples))
        return s, plan(s, get_device("a100-80gb"), budget, estimators=estimators())

    scenario, free = cost(4, None)
    most, per_sample = reweight_sample_limit(scenario, free["reweight"], free["reweight"].peak_bytes)
    assert most == 4 and per_sample > 0  # its own peak: exactly these samples
    budget = free["reweight"].peak_bytes + per_sample // 2  # room for half a sample more
    for samples, fits in ((4, True), (5, False), (3, True)):
        scenario, planned = cost(samples, budget)
        assert planned["reweight"].fits is fits
        assert reweight_sample_limit(scenario, planned["reweight"], budget)[0] == 4
    # Per-sample gradients (two per sample and trained step with the KL term's cotangent) dominate: whole, but for
    # the linear weights kept as their factors (the adaLN modulations' at least)
    profile = scenario.profile
    whole = sum(p.numel() for p in trainer.trainable)
    assert 0 < profile.factored_params < whole
    gradient = (whole - profile.factored_params) * 4 + profile.factors_per_cotangent * 4
    assert per_sample >= 2 * config.num_trained_steps * gradient


@pytest.mark.timing
def test_under_that_budget_auto_is_no_slower_than_the_fastest_schedule_that_fits():
    config = _BUDGET_CONFIG
    free = optimize(_trainer(config), samples_per_step=4).plan.cost
    limit = free["native"].peak_bytes + (free["retain"].peak_bytes - free["native"].peak_bytes) // 2
    auto = optimize(_trainer(config), memory_limit=limit, samples_per_step=4)
    cost = auto.plan.cost
    fitting = [s for s in ("native", "retain", "reweight") if cost[s].fits]
    programs = {"auto": auto, **{s: optimize(_trainer(config), s) for s in fitting}}
    # Short steps whose times spread by 20-40% from round to round on a shared machine: the median of 15 ratios of
    # steps run back to back.
    times = _interleaved_times(programs, 15)
    auto_speedup = {s: paired_speedup(times[s], times["auto"], "cpu") for s in fitting}
    assert min(auto_speedup.values()) >= 1 / 1.03, auto_speedup


def test_leancompile_plan_prints_a_table_and_json(capsys):
    assert cli(["plan", "--model", "wan2.1-1.3b", "--device", "rtx-4090", "--resolution", "256", "--frames", "9",
                "--trainer", "flowgrpo", "--denoising-steps", "10", "--timestep-fraction", "0.99",
                "--guidance-scale", "4.5", "--samples", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["schedules"]) == {"native", *map(str, SCHEDULES), "auto"}
    for estimate in out["schedules"].values():
        assert {"fits", "peak_bytes", "speedup"} <= set(estimate)
    auto = out["schedules"]["auto"]
    assert auto["fits"] and auto["peak_bytes"] <= out["budget_bytes"]
    assert auto["speedup"] >= max(e["speedup"] for e in out["schedules"].values() if e["fits"]) - 1e-9
    assert cli(["plan", "--model", "wan2.1-1.3b", "--device", "h1000"]) == 2
    assert "unknown device 'h1000'" in capsys.readouterr().err


def test_flops_are_counted_for_products_and_for_the_cpus_attention_kernels():
    a, b = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4)
    with FlopCounter() as counter:
        (a @ b).sum().backward()
    assert counter.total == 2 * (2 * 8 * 16 * 4)  # the product, and its gradient for a
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with FlopCounter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    forward = 2 * (2 * 1 * 2 * 5 * 5 * 8)  # q @ k^T and the weights @ v
    assert counter.total == forward + int(2.5 * forward)  # the backward runs five such products


def test_fsdp1_and_zero3_shard_as_fsdp2_and_say_what_they_gather_hold_and_serve():
    """FSDP1 FULL_SHARD and ZeRO-3 keep each rank's shard as FSDP2 does, below DDP's whole copies, and hold two
    blocks gathered in a call; SHARD_GRAD_OP holds every block gathered from its forward to its backward and gathers
    only in the update's forwards. Retain per block keeps the same activations under all; neither FSDP1's Reweight
    nor ZeRO-3's is served yet (the reason given)."""
    trainer = _trainer(FlowGRPOConfig(num_steps=3, group_size=2, train_batch_size=4, lora_rank=None))
    base = dataclasses.replace(trainer_scenario(trainer, 4), world_size=8)
    costs = {name: plan(dataclasses.replace(base, sharding=name), get_device("a100-80gb"), estimators=estimators())
             for name in ("ddp", "fsdp", "fsdp1", "fsdp1-grad-op", "zero3")}
    native = {name: dict(cost["native"].components) for name, cost in costs.items()}
    sharded = ("weights", "gradients", "optimizer (AdamW)")
    for name in ("fsdp1", "fsdp1-grad-op", "zero3"):
        assert all(native[name][k] == native["fsdp"][k] == native["ddp"][k] // 8 for k in sharded), name
    assert native["fsdp1"]["gathered blocks"] == native["fsdp"]["gathered blocks"] == native["zero3"]["gathered blocks"]
    assert costs["fsdp1"]["native"].peak_bytes == costs["fsdp"]["native"].peak_bytes < costs["ddp"]["native"].peak_bytes
    whole = native["ddp"]["weights"]
    assert native["fsdp1-grad-op"]["gathered blocks"] == whole > native["fsdp1"]["gathered blocks"] > 0
    assert costs["fsdp1-grad-op"]["native"].peak_bytes > costs["fsdp1"]["native"].peak_bytes
    retained = {name: dict(costs[name]["retain"].components)["retained activations"]
                for name in ("fsdp", "fsdp1", "zero3")}
    assert retained["fsdp1"] == retained["zero3"] == retained["fsdp"] > 0
    assert costs["fsdp1"]["retain"].available and costs["zero3"]["retain"].available
    limits = {name: dict(cost.limits) for name, cost in costs.items()}
    assert "Retain per block (FSDP1 FULL_SHARD)" in limits["fsdp1"] and "fits" in limits["fsdp1"][
        "Retain per block (FSDP1 FULL_SHARD)"]
    gathers = {name: limits[name][f"all-gathers per GRPO step ({label})"]
               for name, label in (("fsdp1", "FSDP1 FULL_SHARD"), ("fsdp1-grad-op", "FSDP1 SHARD_GRAD_OP"))}
    assert gathers["fsdp1"] != gathers["fsdp1-grad-op"] and "the rollout's calls 0" in gathers["fsdp1-grad-op"]
    for name, label in (("fsdp1", "FSDP1"), ("zero3", "ZeRO-3")):
        assert not costs[name]["reweight"].available and label in costs[name]["reweight"].note
    assert costs["zero3"]["auto"].runs == costs["fsdp1"]["auto"].runs != "native"
    assert "Retain per block (DeepSpeed ZeRO-3)" in limits["zero3"]
    with pytest.raises(ValueError, match="sharding must be one of"):
        dataclasses.replace(base, sharding="zero2")


def test_leancompile_plan_names_the_sharding_and_whether_retain_per_block_fits(capsys):
    settings = ["--model", "wan2.1-1.3b", "--device", "rtx-4090", "--resolution", "256", "--frames", "9",
                "--full", "--samples", "1", "--world-size", "8"]
    assert cli(["plan", *settings, "--sharding", "fsdp1"]) == 0
    out = capsys.readouterr().out
    assert "world 8 FSDP1 FULL_SHARD" in out.splitlines()[0]
    assert "all-gathers per GRPO step (FSDP1 FULL_SHARD)" in out and "gathered blocks" in out
    line = next(line for line in out.splitlines() if "Retain per block (FSDP1 FULL_SHARD)" in line)
    assert line.endswith(("fits", "does not fit"))
    assert "auto runs native" in out or "(per block)" in out
    with pytest.raises(SystemExit):
        cli(["plan", *settings, "--sharding", "zero2"])
    assert "'zero3'" in capsys.readouterr().err  # the known ones named
