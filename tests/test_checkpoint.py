"""Checkpoints: atomic, complete, and a run killed with SIGKILL resumes to the uninterrupted result bitwise."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from leancompile.trainers import FlowGRPOConfig

RUN = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from conftest import PromptTable, mean_reward
    from leancompile import backbones
    from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer
    from pathlib import Path
    out, total, pause = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    backbone = backbones.tiny("sd3", seed=0)
    prompts = PromptTable(backbone)
    config = FlowGRPOConfig(num_steps=3, group_size=2, guidance_scale=2.0, ema=True, train_batch_size=3)
    trainer = FlowGRPOTrainer(config, backbone, mean_reward, prompts, uncond=prompts.uncond)
    ckpt = out / "state.safetensors"
    if ckpt.exists():
        trainer.load(ckpt)
    while trainer.global_step < total:
        trainer.step([1 + trainer.global_step % 3, 2])
        trainer.save(ckpt)
        if trainer.global_step == pause:
            (out / "paused").write_text("")
            import time; time.sleep(600)  # killed here by the test
    torch.save({{k: v for k, v in trainer.trainable_state().items()}}, out / "final.pt")
""")


def _run(script, out, total, pause=-1):
    return subprocess.Popen([sys.executable, str(script), str(out), str(total), str(pause)])


def test_resume_after_sigkill_is_bitwise_equal(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN.format(tests=os.path.dirname(__file__)))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    reference = _run(script, straight, 3)
    victim = _run(script, killed, 3, pause=2)
    deadline = time.time() + 300
    while not (killed / "paused").exists():
        assert victim.poll() is None and time.time() < deadline, "the run to be killed ended early"
        time.sleep(0.1)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert _run(script, killed, 3).wait() == 0
    assert reference.wait() == 0
    a, b = torch.load(straight / "final.pt"), torch.load(killed / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_holds_weights_optimizer_ema_and_generators(make_trainer, tmp_path):
    config = FlowGRPOConfig(num_steps=2, group_size=2, ema=True)
    trainer = make_trainer(config)
    trainer.step([1])
    trainer.save(tmp_path / "c.safetensors")
    keys = load_file(tmp_path / "c.safetensors").keys()
    assert {k.split("/")[0] for k in keys} == {"param", "optim", "ema", "rng"}
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the temporary file was renamed
    other = make_trainer(config)
    other.load(tmp_path / "c.safetensors")
    assert other.global_step == 1 and other.optimizer_steps == trainer.optimizer_steps
    s1, s2 = trainer.step([2]), other.step([2])
    assert s1["loss"] == s2["loss"]


def test_loading_into_a_different_config_names_the_fields(make_trainer, tmp_path):
    trainer = make_trainer(FlowGRPOConfig(num_steps=2, group_size=2))
    trainer.save(tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"differing fields: \['group_size'\]"):
        make_trainer(FlowGRPOConfig(num_steps=2, group_size=3)).load(tmp_path / "c.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.load(tmp_path / "missing.safetensors")
