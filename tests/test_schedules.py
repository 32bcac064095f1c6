"""The schedule registry: every entry point reads it, a refused schedule falls back as its record says, and each
schedule's cost estimate answers for what it holds."""
import dataclasses
import math

import pytest

from leancompile import backbones, optimize
from leancompile.request import OPTIMIZE_SCHEDULES as REQUESTS, WRAP_SCHEDULES
from leancompile.cli import main as cli
from leancompile.cost import get_device, plan as cost_plan, trainer_scenario
from leancompile.cost.scenario import reweight_buffers
from leancompile.plan import Action, Schedule
from leancompile.schedules import SCHEDULES, estimators
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer
from leancompile.wrapping import wrap

from conftest import PromptTable, mean_reward


def _trainer(**kw):
    config = FlowGRPOConfig(**{"num_steps": 3, "timestep_fraction": 0.67, "group_size": 2, "train_batch_size": 2,
                               "dtype": "float64", **kw})
    backbone = backbones.tiny("sd3", seed=0)
    return FlowGRPOTrainer(config, backbone, mean_reward, PromptTable(backbone))


@pytest.mark.fast
def test_every_registered_schedule_is_offered_everywhere_it_could_run(capsys):
    names = [str(name) for name in SCHEDULES]
    assert set(names) <= set(REQUESTS) and set(WRAP_SCHEDULES) == {"auto", *names}
    for name in names:  # the command line's choices come from the registry too
        with pytest.raises(SystemExit):
            cli(["tiny-report", "--schedule", name, "--help"])
    assert "invalid choice" not in capsys.readouterr().err
    cost = optimize(_trainer()).plan.cost
    assert [e.schedule for e in cost.estimates] == ["native", *names, "auto"]
    for name in names:
        assert optimize(_trainer(), name).plan.schedule == name
        wrapped = wrap(backbones.tiny("sd3", seed=0), schedule=name)
        assert type(wrapped.engine.schedule_runtime) is SCHEDULES[name].runtime
        assert wrapped.engine.policy.action.kind is Action(name)


@pytest.mark.fast
def test_a_refused_schedule_falls_back_as_its_record_says():
    plan = optimize(_trainer(), "offload", bitwise=True).plan
    [refusal] = [r for r in plan.refusals if r.schedule is Schedule.OFFLOAD]
    assert SCHEDULES[Schedule.OFFLOAD].fallback is plan.schedule is Schedule.RETAIN
    assert "bitwise=True" in refusal.reason and plan.choice == f"{refusal} -> retain"
    assert {r.schedule for r in plan.refusals} == {Schedule.OFFLOAD, Schedule.REWEIGHT}


def test_offload_holds_natives_device_memory_and_pays_both_copies_over_the_host_link():
    trainer = _trainer(sample_batch_size=1)
    samples = 4
    scenario = trainer_scenario(trainer, samples, buffers=reweight_buffers(trainer.config, False, samples))
    device = get_device("h100-80gb")
    cost = cost_plan(scenario, device, estimators=estimators())
    native, retain, offload = cost["native"], cost["retain"], cost["offload"]
    assert offload.peak_bytes == native.peak_bytes < retain.peak_bytes
    held = dict(retain.components)["retained activations"]
    copies = 2 * held / device.host_link
    assert offload.seconds == pytest.approx(retain.seconds + copies, rel=1e-9)
    assert offload.flops == retain.flops
    assert all(a.kind is Action.OFFLOAD for a in offload.steps)
    # Where the device's memory is the host's there is nothing to offload to, and the planner says so.
    on_host = cost_plan(scenario, dataclasses.replace(device, host_link=None), estimators=estimators())
    assert not on_host["offload"].fits and math.isinf(on_host["offload"].seconds)
    assert "nothing to offload to" in on_host["offload"].note
