import pytest
import torch

from leancompile import backbones

# Tiny models gain nothing from intra-op threads, and lose much when the cores are shared.
torch.set_num_threads(1)


class PromptTable:
    """Prompts are integers; each maps to a fixed random conditioning row of the backbone."""

    def __init__(self, backbone, num=8, seed=0):
        self.table = backbone.dummy_conditioning(num, generator=torch.Generator().manual_seed(seed))

    def __call__(self, prompts):
        return self.table.index(torch.as_tensor(list(prompts)))

    @property
    def uncond(self):
        return self.table.index(torch.tensor([0]))


def mean_reward(samples, prompts):
    """A smooth, prompt-dependent reward with spread inside every group."""
    weights = torch.tensor([float(p) + 1 for p in prompts])
    return samples.flatten(1).mean(1) * weights + samples.flatten(1).std(1)


@pytest.fixture
def make_trainer():
    from leancompile.trainers import DanceGRPOTrainer, FlowGRPOTrainer

    def build(config, family="sd3", seed=0, reward=mean_reward):
        backbone = backbones.tiny(family, seed=seed)
        prompts = PromptTable(backbone)
        cls = FlowGRPOTrainer if config.algorithm == "flowgrpo" else DanceGRPOTrainer
        return cls(config, backbone, reward, prompts, uncond=prompts.uncond if config.use_cfg else None)

    return build
