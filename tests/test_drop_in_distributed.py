"""``leancompile.wrap`` inside ``DistributedDataParallel``: two gloo processes run the LLM GRPO loop with the model
as ``DDP(model)`` and as ``DDP(leancompile.wrap(model))``, each rank on its own questions; the weights after two
GRPO steps agree to float64 rounding, and the update's calls are served."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from examples import grpo_llm
from conftest import spawn_ranks
from test_drop_in import DenseRewardLLM

WORLD = 2


class DataParallelLLM(DenseRewardLLM):
    """The loop with its model in DDP, as a multi-GPU script has it (generation runs on the inner model)."""

    def __init__(self, config, use_leancompile):
        super().__init__(config, use_leancompile)
        self.model = DistributedDataParallel(self.model)

    def rollout(self, questions):
        ddp, self.model = self.model, self.model.module
        try:
            return super().rollout(questions)
        finally:
            self.model = ddp


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    config = grpo_llm.Config(prompts=2, group=4, micro_batch=4, seed=rank, dtype=torch.float64)
    results = {}
    for use in (False, True):
        loop = DataParallelLLM(config, use)  # DDP broadcasts rank 0's weights
        loop.optimizer = torch.optim.SGD(loop.model.parameters(), lr=0.05)
        weights = lambda: torch.cat([p.detach().flatten() for p in loop.model.parameters()])  # noqa: E731
        start = weights()
        for _ in range(2):
            loop.step()
        stats = loop.model.module.stats() if use else {}
        results[use] = (weights() - start, stats)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("ranks"))


def test_wrapped_inside_ddp_trains_as_ddp_alone(ranks):
    for rank in ranks:
        (native, _), (wrapped, stats) = rank[False], rank[True]  # the weights' change in two steps
        assert native.norm() > 0
        assert float((wrapped - native).norm() / native.norm()) <= 1e-10
        assert stats["served_calls"] == 2 * 2, stats  # two micro-batches per step, two steps
    assert torch.equal(ranks[0][True][0], ranks[1][True][0])  # the ranks stay in sync
