"""FSDP2 in torchtitan's order (UniRL's default): torch's ``checkpoint_wrapper`` around every block, ``fully_shard``
on each wrapped block with resharding after forward, then on the root; the rollout in ``eval()`` without grad, the
update in ``train()``. The root's parameters stay unsharded after a forward (FSDP2 does not reshard the root) and are
freed when it reshards: the engine reads each block's and the root's sharded parameters, never the unsharded ones,
even where a module registered anywhere makes the wrapper look at the module again between the rollout and the
update. Two gloo ranks; the weights after two GRPO steps are FSDP2 alone's to float64 rounding, and every update
call's blocks are served."""
import os

import torch
import torch.distributed as dist

import leancompile
from conftest import spawn_ranks
from examples import dancegrpo_flux
from examples.loop_cli import trained_module
from leancompile.runtime.regional import RegionalEngine, transformer_blocks

WORLD = 2


class CheckpointedShardedFlux(dancegrpo_flux.Loop):
    """The Flux loop sharded the way torchtitan and UniRL shard: blocks checkpoint-wrapped, then sharded."""

    def __init__(self, config, use_leancompile, wrap_first):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
        from torch.distributed.fsdp import fully_shard

        super().__init__(config, use_leancompile=False)
        self.use_leancompile = use_leancompile
        if use_leancompile and wrap_first:  # the structure is read when the module is called
            self.transformer = leancompile.wrap(self.transformer)
        for stack in (self.transformer.transformer_blocks, self.transformer.single_transformer_blocks):
            for i, block in enumerate(stack):
                stack[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        for block in transformer_blocks(self.transformer):
            fully_shard(block, reshard_after_forward=True)
        fully_shard(self.transformer)
        if use_leancompile and not wrap_first:
            self.transformer = leancompile.wrap(self.transformer)

    def update(self, *args, **kwargs):
        torch.nn.Linear(2, 2)  # a registration anywhere: the wrapper looks at its module's parameters again
        return super().update(*args, **kwargs)


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for case in ("native", "wrapped after", "wrapped before"):
        config = dancegrpo_flux.Config(num_steps=4, dtype=torch.float64, seed=rank)
        loop = CheckpointedShardedFlux(config, case != "native", case == "wrapped before")
        module = trained_module(loop)
        loop.optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        weights = lambda: torch.cat([p.to_local().detach().flatten() for p in module.parameters()])  # noqa: E731
        start = weights()
        for _ in range(2):
            loop.step()
        stats = module.stats() if case != "native" else {}
        per_block = case != "native" and isinstance(module.engine, RegionalEngine)
        results[case] = (weights() - start, stats, per_block)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_checkpoint_wrapped_blocks_sharded_by_fsdp2_are_served_exactly(tmp_path):
    for rank in spawn_ranks(_worker, WORLD, tmp_path):
        native = rank["native"][0]
        assert native.norm() > 0
        for case in ("wrapped after", "wrapped before"):
            change, stats, per_block = rank[case]
            assert per_block, case
            assert float((change - native).norm() / native.norm()) <= 1e-10, case
            assert stats["served_calls"] > 0 and stats["recomputed_calls"] == 0, (case, stats)
