"""DeepSpeed ZeRO-3 on two gloo ranks (DeepSpeed's CPU accelerator), DanceGRPO's Flux loop: stage 3 partitions every
parameter (``stage3_param_persistence_threshold=0``: none kept whole), gathers each submodule's own parameters in
its pre-forward hook and frees them after, gathers them again before its backward and reduce-scatters the
gradients. ZeRO-3 takes float32, bfloat16 or float16 parameters only (``deepspeed.zero.Init`` refuses float64), so
the loop runs in float32. Serving a block from kept tensors would skip its submodules' calls and so their gathers:
a ZeRO-3 module runs natively, bitwise ZeRO-3 alone, with every collective, and says why; the weights' digest reads
each parameter's own partition, never the empty or freed tensor the parameter holds."""
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import leancompile
from conftest import spawn_ranks
from examples import dancegrpo_flux
from leancompile.runtime.digest import digest

WORLD = 2
ACCUMULATION = 2  # samples per optimizer step: two optimizer steps per rollout of four samples
CONFIG = dancegrpo_flux.Config(num_steps=4, dtype=torch.float32)
TRAINED = int((CONFIG.num_steps - 1) * CONFIG.timestep_fraction)


class Zero3Flux(dancegrpo_flux.Loop):
    """The example's Flux loop in a ZeRO-3 ``DeepSpeedEngine``, its module wrapped by leancompile or not."""

    def __init__(self, config, wrapped: bool):
        import deepspeed

        super().__init__(config, use_leancompile=False)
        settings = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION * TRAINED,
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                    "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
        # Plain SGD: Adam's first steps are sign-like and would hide a gradient's difference.
        optimizer = torch.optim.SGD(self.transformer.parameters(), lr=0.05)
        self.transformer, self.optimizer, _, _ = deepspeed.initialize(model=self.transformer, optimizer=optimizer,
                                                                      config=settings, dist_init_required=False)
        self.wrapped = leancompile.wrap(self.transformer.module) if wrapped else None

    def train(self, samples: dict, rewards: torch.Tensor) -> None:
        """DanceGRPO's update at micro-batch 1, DeepSpeed's way: ``backward`` and ``step`` after each trained step,
        the optimizer stepping at each accumulation boundary (``ACCUMULATION`` samples)."""
        c = self.config
        grouped = rewards.reshape(-1, c.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-8)).reshape(-1)
        perms = torch.stack([torch.randperm(c.num_steps - 1, generator=self.generator) for _ in rewards])
        for n in range(len(rewards)):
            for j in perms[n, :TRAINED].tolist():
                loss = self.loss(samples, advantages, n, j) / (ACCUMULATION * TRAINED)
                self.transformer.backward(loss, scale_wrt_gas=False)
                self.transformer.step()

    def step(self) -> list[float]:
        self.transformer.eval()
        samples = self.rollout()
        rewards = -((samples["latents"][:, -1] - self.target) ** 2).mean(dim=(1, 2))
        self.transformer.train()
        self.train(samples, rewards)
        return rewards.tolist()

    def partitions(self) -> torch.Tensor:
        return torch.cat([p.ds_tensor.detach().flatten() for p in self.transformer.module.parameters()])


class Collectives:
    """Counts DeepSpeed's gathers and reduce-scatters (through its communication backend)."""

    NAMES = ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

    def __init__(self):
        from deepspeed.comm import comm

        self.counts = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            original = getattr(comm.cdb, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(comm.cdb, name, counted)
        self.backend = comm.cdb

    def restore(self) -> None:
        for name in self.NAMES:
            delattr(self.backend, name)


def _run(wrapped: bool) -> dict:
    import deepspeed

    config = dancegrpo_flux.Config(num_steps=CONFIG.num_steps, dtype=CONFIG.dtype, seed=dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = Zero3Flux(config, wrapped)
        params = list(loop.transformer.module.parameters())
        # The digest reads each parameter's partition, gathered now or not
        read = digest(params)
        with deepspeed.zero.GatheredParameters(params):
            gathered = all(p.numel() == p.ds_numel for p in params) and torch.equal(digest(params), read)
        partitioned = not any(p.numel() for p in params) and torch.equal(read, digest([p.ds_tensor for p in params]))
        collectives = Collectives()
        start = loop.partitions()
        rewards = [loop.step() for _ in range(2)]
        collectives.restore()
    told = [str(w.message) for w in caught if issubclass(w.category, leancompile.NothingServedWarning)]
    return dict(change=loop.partitions() - start, rewards=rewards, told=told, collectives=collectives.counts,
                stats=loop.wrapped.stats() if wrapped else {}, moved=not torch.equal(digest(params), read),
                gathered=gathered, partitioned=partitioned)


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {wrapped: _run(wrapped) for wrapped in (False, True)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_zero3_runs_natively_exactly_and_says_why(tmp_path):
    pytest.importorskip("deepspeed")
    for rank in spawn_ranks(_worker, WORLD, tmp_path):
        native, wrapped = rank[False], rank[True]
        assert native["change"].norm() > 0
        assert wrapped["change"].equal(native["change"])  # natively: bitwise ZeRO-3's
        assert wrapped["rewards"] == native["rewards"]
        assert wrapped["collectives"] == native["collectives"] and native["collectives"]["all_gather_into_tensor"]
        assert wrapped["told"] and all("ZeRO-3" in told for told in wrapped["told"]), wrapped["told"]
        assert wrapped["stats"]["served_calls"] == 0
        assert set(wrapped["stats"]["recompute_reasons"]) == {"unsupported"}, wrapped["stats"]
        for run in (native, wrapped):  # the partition read, whatever is gathered; an optimizer step seen
            assert run["gathered"] and run["partitioned"] and run["moved"]
