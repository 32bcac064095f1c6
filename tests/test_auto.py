"""auto's two safeguards: the planner prices the per-row program's measured per-operator cost and compile, and the
optimized trainer tries the program against native over whole steps and falls back to native where it measures
slower. Calibrations and clocks are given, not timed: the tests are deterministic."""
import dataclasses
import warnings

import pytest
import torch

from leancompile import backbones, optimize
from leancompile.cost import DEVICES, plan, trainer_scenario
from leancompile.cost.overheads import Overheads
from leancompile.runtime import auto, calibration
from leancompile.schedules import estimators
from leancompile.trainers import FlowGRPOConfig, trainer_class

from conftest import PromptTable, mean_reward, steps_clock

FLOOR = auto.AUTO_FLOOR  # conftest's fixture sets it to 0 for the other tests
MEASURE = calibration.overheads  # and replaces the calibration

# The test size the report was about: 8 denoising steps, 6 trained, groups of 4
CONFIG = FlowGRPOConfig(num_steps=8, timestep_fraction=0.75, group_size=4)
# Per operator (µs): the per-row program's fixed costs far above eager's, as at small sizes on a slow host
DOMINANT = Overheads("cpu", 2e-6, 2e-6, 50e-6, 50e-6, 5e-3, 1e-3, (100, 200))
# The program as cheap per operator as eager, no engine cost: only the saved forwards count
NEGLIGIBLE = Overheads("cpu", 2e-6, 2e-6, 2e-6, 2e-6, 0.0, 1e-3, (100, 200))


def _trainer(config=CONFIG, family="sd3", **sizes):
    backbone = backbones.tiny(family, seed=config.seed, **sizes)
    prompts = PromptTable(backbone, seed=config.seed)
    return trainer_class(config.algorithm)(config, backbone, mean_reward, prompts,
                                           uncond=prompts.uncond if config.use_cfg else None)


def _cost(trainer, overheads, run_steps=None):
    """The plan on a fixed device (a registered one: nothing of this machine is measured)."""
    scenario = trainer_scenario(trainer, 2 * trainer.config.group_size)
    return plan(scenario, DEVICES["a100-80gb"], estimators=estimators(), overheads=overheads, run_steps=run_steps)


@pytest.mark.fast
def test_where_the_per_operator_cost_dominates_auto_plans_native_and_says_why_in_numbers():
    cost = _cost(_trainer(), DOMINANT)
    assert cost["auto"].runs == "native"
    assert cost["retain"].seconds > cost["native"].seconds
    note = cost["auto"].note
    assert note.startswith("native: no reuse is predicted faster: native ")
    assert f"retain {cost['retain'].seconds:.3g} s" in note and "the per-row program adds" in note
    assert "per-operator costs: measured on cpu" in str(cost)  # the calibration's device


@pytest.mark.fast
def test_where_it_does_not_auto_retains_every_step():
    cost = _cost(_trainer(), NEGLIGIBLE)
    assert cost["auto"].runs == "retain"
    assert all(a.label == "retain" for a in cost["auto"].steps)
    # with these costs the per-row program's term is the engine-free difference of the saved forwards only
    plain = _cost(_trainer(), None)
    assert plain["auto"].runs == "retain"


@pytest.mark.fast
def test_the_compile_is_shown_and_amortised_where_the_run_length_is_known():
    trainer = _trainer()
    unknown, known = _cost(trainer, NEGLIGIBLE), _cost(trainer, NEGLIGIBLE, run_steps=10)
    operators = trainer_scenario(trainer, 8).profile
    compile_seconds = NEGLIGIBLE.compile_seconds(operators.forward.count + operators.backward.count)
    assert unknown.compile_seconds == pytest.approx(compile_seconds)
    assert f"compiling the per-row program takes about {compile_seconds:.2g} s, not amortised" in str(unknown)
    assert "amortised over the run's 10 GRPO steps" in str(known)
    assert known["retain"].seconds == pytest.approx(unknown["retain"].seconds + compile_seconds / 10)
    assert known["native"].seconds == unknown["native"].seconds
    assert known.to_json()["compile_seconds"] == pytest.approx(compile_seconds)
    with pytest.raises(ValueError, match="run_steps"):
        _cost(trainer, NEGLIGIBLE, run_steps=0)


def test_optimize_shows_the_compile_in_the_plan_and_explain(monkeypatch):
    monkeypatch.setattr(calibration, "overheads", lambda device_type: NEGLIGIBLE)
    optimized = optimize(_trainer(), "auto")
    assert optimized.plan.schedule == "retain"
    assert "first step: compiling the per-row program takes about" in str(optimized.plan)
    assert "first step: compiling the per-row program" in optimized.explain()
    monkeypatch.setattr(calibration, "overheads", lambda device_type: DOMINANT)
    native = optimize(_trainer(), "auto")
    assert native.plan.schedule == "native" and native._engine is None
    assert "no reuse is predicted faster" in native.plan.choice and "per-operator costs" in str(native.plan)


def _weights(trainer):
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


@pytest.mark.parametrize("trials, runs", [((1.2, 1.2), "native"), ((1.2, 0.8), "reweight"), ((0.8,), "retain")])
def test_auto_tries_the_program_against_native_over_whole_steps(monkeypatch, trials, runs):
    """After the step that compiles, three pairs of steps alternate native (nothing served) and the program; the
    median pair decides at the next step. The planner's pick (Retain) measured slower, the runner-up (Reweight) is
    tried the same way from that step on; measured slower too, the trainer runs natively from then on and says why
    in the stats and a warning, else it keeps serving. Either way its weights stay native's."""
    config = dataclasses.replace(CONFIG, dtype="float64", num_steps=4, group_size=2)  # short steps: up to 16 of them
    overrides = {"qk_norm": None}  # SD3.5's float32 RMSNorm would bound float64 agreement (tests of Retain)
    monkeypatch.setattr(calibration, "overheads", lambda device_type: NEGLIGIBLE)
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    monkeypatch.setattr(auto, "now", steps_clock(*trials))
    native, optimized = _trainer(config, **overrides), optimize(_trainer(config, **overrides), "auto")
    assert optimized.plan.schedule == "retain" and "runner-up reweight" in optimized.plan.choice
    steps_tried = 7 * len(trials)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = []
        for _ in range(steps_tried + 2):
            steps.append(optimized.step([1, 2]))
            native.step([1, 2])
    assert all(s["trying"] for s in steps[:steps_tried]) and not any(s["trying"] for s in steps[steps_tried:])
    for trial in range(len(trials)):  # each trial: the program's steps serve, native's serve nothing
        first = 7 * trial
        assert all(steps[first + i]["served_calls"] > 0 for i in (0, 2, 4, 6)), steps
        assert not any(steps[first + i]["served_calls"] for i in (1, 3, 5)), steps
    assert len({frozenset(s) for s in steps}) == 1  # one schema
    said = [str(w.message) for w in caught if "leancompile.optimize: auto:" in str(w.message)]
    if len(trials) > 1:
        assert "0.83x, below 1.02x: the runner-up reweight is tried next" in said[0]
        predicted = optimized.plan.cost.speedup("reweight")
        assert optimized.plan.choice.endswith(f"the runner-up reweight ({predicted:.2f}x predicted) runs instead")
    assert optimized.plan.schedule == (runs if runs != "native" else "reweight")
    if runs == "native":
        assert len(said) == 2 and "the module runs natively from now on" in said[1] and optimized._engine is None
        assert "0.83x, below 1.02x" in steps[-2]["stopped"] and steps[-1]["stopped"] == steps[-2]["stopped"]
        assert steps[-2]["served_calls"] == steps[-1]["served_calls"] == 0
    else:
        assert len(said) == len(trials) - 1 and steps[-1]["stopped"] is None and steps[-1]["served_calls"] > 0
    start = _weights(_trainer(config, **overrides))
    moved = _weights(native) - start
    assert float((_weights(optimized) - start - moved).norm() / moved.norm()) <= 1e-10


@pytest.mark.fast
def test_a_calibration_with_a_negative_cost_is_refused():
    with pytest.raises(ValueError, match="program_forward"):
        Overheads("cpu", 1e-6, 1e-6, -1.0, 1e-6, 0.0, 0.0, (1, 1))


def test_the_calibration_measures_every_cost_and_leaves_the_callers_random_streams_alone():
    """What the calibration returns, not how fast: every cost measured (positive), per operator of a profiled
    call; the caller's random stream where it was; a device it cannot measure refused."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    measured = MEASURE.__wrapped__("cpu")  # not the process's cached value: measured here
    assert torch.equal(torch.rand(4), expected)
    assert measured.device == "cpu" and min(measured.operators) > 0
    assert min(measured.eager_forward, measured.eager_update, measured.program_forward, measured.program_backward,
               measured.compile) > 0
    assert "measured on cpu" in str(measured)
    with pytest.raises(ValueError, match="device_type"):
        MEASURE.__wrapped__("tpu")
