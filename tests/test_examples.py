"""The examples run, and the custom trainer's rewrite trains exactly what its native program trains."""
import sys
from pathlib import Path

import torch

from leancompile import backbones, optimize
from leancompile.tasks.synthetic import RandomPrompts, latent_reward
from leancompile.trainers import FlowGRPOConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import custom_trainer  # noqa: E402
import optimize_digits  # noqa: E402


def test_examples_run(capsys):
    custom_trainer.main()
    optimize_digits.main(steps=1)
    out = capsys.readouterr().out
    assert out.count("schedule=retain") == 2 and "reused_backbone_out_from_rollout" in out


def test_a_custom_loss_with_two_backbone_calls_keeps_the_native_gradient():
    def build():
        backbone = backbones.tiny("sd3", seed=0, qk_norm=None)  # no float32 island (see test_retain_equivalence)
        config = FlowGRPOConfig(num_steps=3, group_size=2, train_batch_size=4, dtype="float64")
        return custom_trainer.VelocityPenaltyTrainer(config, backbone, latent_reward, RandomPrompts(backbone))

    native, retain = optimize(build(), "native"), optimize(build(), "retain")
    start = torch.cat([p.detach().flatten() for p in native.trainable])
    native.step([1, 2])
    stats = retain.step([1, 2])
    assert stats["reused_micro_steps"] == 4  # two calls in each of two micro-steps
    d_native = torch.cat([p.detach().flatten() for p in native.trainable]) - start
    d_retain = torch.cat([p.detach().flatten() for p in retain.trainable]) - start
    assert float((d_native - d_retain).norm() / d_native.norm()) <= 1e-10
