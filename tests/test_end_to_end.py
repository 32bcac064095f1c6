"""A short training run of the digits task: native and auto follow the same trajectory."""
import torch

from leancompile import optimize
from leancompile.tasks import digits
from leancompile.tasks.rewards import DigitsClassifierReward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer

CONFIG = FlowGRPOConfig(num_steps=4, timestep_fraction=0.5, noise_level=0.8, group_size=4, train_batch_size=4,
                        gradient_accumulation_steps=2, lora_rank=4, learning_rate=3e-3, dtype="float64", seed=0)


def _trainer(schedule):
    model = digits.load_pretrained()
    trainer = FlowGRPOTrainer(CONFIG, model.backbone, DigitsClassifierReward(target=3), model.encode)
    return optimize(trainer, schedule=schedule)


def test_native_and_auto_train_the_digits_model_identically():
    native, auto = _trainer("native"), _trainer("auto")
    assert auto.plan.schedule in ("retain", "reweight") and auto.plan.cost["auto"].runs == auto.plan.schedule
    prompts = [digits.NULL_CLASS] * 2
    for _ in range(4):
        n, a = native.step(prompts), auto.step(prompts)
        assert abs(n["reward_mean"] - a["reward_mean"]) <= 1e-8
        assert a["reused_micro_steps"] == 4 and a["recomputed_micro_steps"] == 0
    w_native = torch.cat([p.detach().flatten() for p in native.trainable])
    w_auto = torch.cat([p.detach().flatten() for p in auto.trainable])
    start = torch.cat([p.detach().flatten() for p in _trainer("native").trainable])
    assert float((w_native - w_auto).norm() / (w_native - start).norm()) <= 1e-8
