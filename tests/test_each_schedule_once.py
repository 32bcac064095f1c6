"""Each schedule's equivalence on one fixed configuration (the fast tier's; the hypothesis suites sweep them):
FlowGRPO on SD3 with CFG, a KL term and LoRA, one sample per call, in float64."""
import pytest
import torch

from leancompile import optimize
from leancompile.plan import Schedule
from leancompile.schedules import SCHEDULES
from leancompile.trainers import FlowGRPOConfig

from conftest import check_served_calls, mark_optimizer_steps
from test_retain_equivalence import _build

pytestmark = pytest.mark.fast

CONFIG = FlowGRPOConfig(num_steps=3, timestep_fraction=1.0, group_size=2, sample_batch_size=1, train_batch_size=1,
                        gradient_accumulation_steps=2, lora_rank=2, beta=0.05, guidance_scale=2.0,
                        learning_rate=1e-3, seed=3, dtype="float64")
# name -> optimize's arguments and the schedule the plan must run
CASES = {**{str(name): ({"schedule": str(name)}, str(name)) for name in SCHEDULES},
         "auto": ({"schedule": "auto"}, None),
         "bitwise": ({"schedule": "retain", "bitwise": True}, str(Schedule.RETAIN))}


def _weights(trainer):
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


@pytest.mark.parametrize("name", list(CASES))
def test_each_schedule_trains_as_native_once(name):
    kwargs, schedule = CASES[name]
    native, fast = _build("sd3", CONFIG), optimize(_build("sd3", CONFIG), **kwargs)
    assert schedule is None or fast.plan.schedule == schedule
    marks = mark_optimizer_steps(fast)
    start = _weights(native)
    native_stats, fast_stats = native.step([1, 2]), fast.step([1, 2])
    d_native, d_fast = _weights(native) - start, _weights(fast) - start
    assert native_stats["optimizer_steps"] == fast_stats["optimizer_steps"] > 0
    if kwargs.get("bitwise"):
        assert torch.equal(d_native, d_fast)
    else:
        assert float((d_native - d_fast).norm() / d_native.norm()) <= 1e-10
    assert fast_stats["served_calls"] > 0
    check_served_calls(fast, marks, every_call_served=True)
