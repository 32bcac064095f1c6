"""``leancompile.wrap`` in data-parallel loops, two gloo processes each: the LLM GRPO loop with the model as
``DDP(model)`` and as ``DDP(leancompile.wrap(model))``, each rank on its own questions; and the DanceGRPO-style Flux
loop with the transformer sharded by FSDP2 (``fully_shard`` per block and at the root) and then wrapped, which
runs per block under FSDP2's own gathers. In both the weights after two GRPO steps agree to float64 rounding and
the update's calls are served."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import leancompile
from examples import dancegrpo_flux, grpo_llm
from examples.loop_cli import trained_module
from leancompile.runtime.regional import RegionalEngine, transformer_blocks
from conftest import spawn_ranks
from test_drop_in import REWEIGHT_FLOAT32_ISLAND, DenseRewardLLM

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


def _change_in_two_steps(loop, module, local) -> torch.Tensor:
    """The change of ``module``'s weights on this rank (``local``: a parameter's tensor here) over two GRPO steps of
    ``loop`` with plain SGD (Adam's first steps are sign-like and would hide a gradient's difference)."""
    loop.optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    weights = lambda: torch.cat([local(p).detach().flatten() for p in module.parameters()])  # noqa: E731
    start = weights()
    for _ in range(2):
        loop.step()
    return weights() - start


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    config = grpo_llm.Config(prompts=2, group=4, micro_batch=4, seed=rank, dtype=torch.float64)
    results = {}
    for use in (False, True):
        loop = DataParallelLLM(config, use)  # DDP broadcasts rank 0's weights
        change = _change_in_two_steps(loop, loop.model, lambda p: p)
        results[use] = (change, loop.model.module.stats() if use else {})
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


class FullyShardedFlux(dancegrpo_flux.Loop):
    """The Flux loop with its transformer sharded as an FSDP2 script shards it, then (optionally) wrapped; FSDP2's
    all-gathers and reduce-scatters counted."""

    def __init__(self, config, use_leancompile):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        super().__init__(config, use_leancompile=False)
        self.use_leancompile = use_leancompile
        self.collectives = counts = {"all_gather": 0, "reduce_scatter": 0}

        class CountedAllGather(DefaultAllGather):
            def __call__(self, *args, **kwargs):
                counts["all_gather"] += 1
                return super().__call__(*args, **kwargs)

        class CountedReduceScatter(DefaultReduceScatter):
            def __call__(self, *args, **kwargs):
                counts["reduce_scatter"] += 1
                return super().__call__(*args, **kwargs)

        for block in transformer_blocks(self.transformer):
            fully_shard(block)
        fully_shard(self.transformer)
        for module in self.transformer.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(CountedAllGather())
                module.set_custom_reduce_scatter(CountedReduceScatter())
        if use_leancompile:  # per block: a submodule is sharded by FSDP2
            self.transformer = leancompile.wrap(self.transformer, schedule=config.schedule)


def _fsdp_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for schedule in (None, "retain", "reweight"):  # None: FSDP2 alone
        config = dancegrpo_flux.Config(num_steps=6, dtype=torch.float64, seed=rank, schedule=schedule or "retain")
        loop = FullyShardedFlux(config, schedule is not None)
        module = trained_module(loop)
        change = _change_in_two_steps(loop, module, lambda p: p.to_local())  # this rank's shards
        stats = module.stats() if schedule else {}
        per_block = isinstance(module.engine, RegionalEngine) if schedule else False
        results[schedule] = (change, stats, dict(loop.collectives), per_block)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    return spawn_ranks(_fsdp_worker, WORLD, tmp_path_factory.mktemp("fsdp_ranks"))


@pytest.mark.parametrize("schedule, tolerance", [("retain", 1e-10), ("reweight", REWEIGHT_FLOAT32_ISLAND)])
def test_wrapped_under_fsdp2_runs_per_block_and_trains_as_fsdp2_alone(fsdp_ranks, schedule, tolerance):
    """Reweight per block keeps each block's per-row gradients as FSDP2 gathered the block (unreduced) and hands
    their combination to FSDP2's reduce-scatter; its provisional backward reduce-scatters nothing. Flux's float32
    islands bound its difference (see test_drop_in)."""
    for rank in fsdp_ranks:
        (native, _, native_collectives, _), (wrapped, stats, collectives, per_block) = rank[None], rank[schedule]
        assert per_block and native.norm() > 0
        assert float((wrapped - native).norm() / native.norm()) <= tolerance
        # Every update call's blocks served: 2 steps x 2 prompts x 2 samples x 3 trained steps, 4 blocks each.
        assert stats["served_calls"] == 2 * 2 * 2 * 3 * 4 and stats["recomputed_calls"] == 0, stats
        # FSDP2's own per-block collectives, no whole-model gather: as many reduce-scatters as native's. Retain
        # gathers no more than native (a served block's backward gathers its weights once; native's checkpointed
        # backward gathers them for its recomputation too). Reweight's heads run the module's forward once more
        # (gathering no answered block) and its backward where a head's cotangent is not zero (the per-row backward
        # needs the weights): 506 against native's 408.
        assert collectives["reduce_scatter"] == native_collectives["reduce_scatter"] > 0
        bound = native_collectives["all_gather"] * (1 if schedule == "retain" else 5 / 4)
        assert 0 < collectives["all_gather"] <= bound, (collectives, native_collectives)
