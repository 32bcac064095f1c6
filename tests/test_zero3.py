"""DeepSpeed ZeRO-3 on two gloo ranks (DeepSpeed's CPU accelerator), DanceGRPO's Flux loop (the rollout in ``eval()``
under ``no_grad``, per sample its own trained step, two optimizer steps per rollout): stage 3 partitions every
parameter (``stage3_param_persistence_threshold=0``: none kept whole), gathers a module's parameters in its
pre-forward hook and frees them after, gathers them again before its backward and reduce-scatters the gradients.

With each transformer block a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``, or the configuration's
``zero_optimization.leaf_module``: the block's hooks gather its whole tree), ``leancompile.wrap`` of the engine's
module, or of the transformer before ``deepspeed.initialize``, serves it per block: each block's forward is routed
to the block's engine while DeepSpeed's hooks run around it. The weights after two GRPO steps are ZeRO-3 alone's to
float32's rounding, every update call before a rollout's first optimizer step is served, and ZeRO-3 runs as many
gathers and reduce-scatters, of as many elements, per optimizer step as natively. Without leaf blocks a served block
would skip its submodules' gathers: the module runs natively, bitwise ZeRO-3 alone, and the warning names
``set_z3_leaf_modules``. ZeRO-3 takes float32, bfloat16 or float16 parameters only (``deepspeed.zero.Init`` refuses
float64), so the loop runs in float32. The weights' digest reads each parameter's own partition, never the empty or
freed tensor the parameter holds."""
import collections
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import leancompile
from conftest import spawn_ranks
from examples import dancegrpo_flux
from leancompile.runtime.digest import digest
from leancompile.runtime.regional import RegionalEngine, transformer_blocks

WORLD = 2
ACCUMULATION = 2  # samples per optimizer step: two optimizer steps per rollout of four samples
CONFIG = dancegrpo_flux.Config(num_steps=4, dtype=torch.float32)
TRAINED = int((CONFIG.num_steps - 1) * CONFIG.timestep_fraction)
FLOAT32 = 1e-6  # float32's rounding of the trained weights' change (its epsilon is 1.2e-7)


class Zero3Flux(dancegrpo_flux.Loop):
    """The example's Flux loop in a ZeRO-3 ``DeepSpeedEngine``, its transformer's blocks made ZeRO-3 leaf modules by a
    ``leaves`` (``set_z3_leaf_modules`` before ``deepspeed.initialize``, or the configuration's ``leaf_module``;
    None: not), wrapped by leancompile ``where`` (after ``deepspeed.initialize``, before it, or None: not wrapped)."""

    def __init__(self, config, where: str | None, leaves: str | None):
        import deepspeed

        super().__init__(config, use_leancompile=False)
        transformer = self.transformer
        classes = sorted({type(b).__name__ for b in transformer_blocks(transformer)})
        if leaves == "call":
            deepspeed.utils.set_z3_leaf_modules(transformer, classes)
        if where == "before":
            transformer = leancompile.wrap(transformer)
        # DeepSpeed prefetches, and keeps gathered for reuse, along the module order it traced: a served step's
        # order differs (its blocks' backward recomputes nothing under gradient checkpointing), so that with both on
        # a step may gather a block early or once more (the same elements over the run, in other calls). Off, every
        # gather is a module's own fetch, counted per step.
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                "stage3_max_reuse_distance": 0}
        if leaves == "config":  # what a configuration file (accelerate's deepspeed_config_file) can say
            zero["leaf_module"] = {"classes": classes}
        settings = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION * TRAINED,
                    "zero_optimization": zero,
                    "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
        # Plain SGD: Adam's first steps are sign-like and would hide a gradient's difference.
        optimizer = torch.optim.SGD(transformer.parameters(), lr=0.05)
        self.transformer, _, _, _ = deepspeed.initialize(model=transformer, optimizer=optimizer, config=settings,
                                                         dist_init_required=False)
        self.wrapped = leancompile.wrap(self.transformer.module) if where == "after" else \
            self.transformer.module if where else None
        self.calls_at_steps = []  # the wrapper's block-call records made before each optimizer step
        optimizer.register_step_pre_hook(lambda *_: self.calls_at_steps.append(self.records()))

    def records(self) -> list:
        return list(self.wrapped.last_calls) if self.wrapped is not None else []

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
    """Counts DeepSpeed's gathers and reduce-scatters (through its communication backend) and their elements, per
    optimizer step."""

    def __init__(self):
        from deepspeed.comm import comm

        self.counts = collections.Counter()
        self.backend = comm.cdb
        for name, position in (("all_gather_into_tensor", 0), ("reduce_scatter_tensor", 1)):
            original = getattr(self.backend, name)

            def counted(*args, _name=name, _original=original, _position=position, **kwargs):
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                self.counts[_name, "elements"] += tensors[_position].numel()  # the whole tensor: gathered, or reduced
                self.counts[_name, "calls"] += 1
                return _original(*args, **kwargs)

            setattr(self.backend, name, counted)

    def take(self) -> tuple:
        taken = tuple(self.counts[name, part] for name in ("all_gather_into_tensor", "reduce_scatter_tensor")
                      for part in ("calls", "elements"))
        self.counts.clear()
        return taken

    def restore(self) -> None:
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            delattr(self.backend, name)


def _run(where: str | None, leaves: str | None) -> dict:
    import deepspeed

    config = dancegrpo_flux.Config(num_steps=CONFIG.num_steps, dtype=CONFIG.dtype, seed=dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = Zero3Flux(config, where, leaves)
        params = list(loop.transformer.module.parameters())
        # The digest reads each parameter's partition, gathered now or not
        read = digest(params)
        with deepspeed.zero.GatheredParameters(params):
            gathered = all(p.numel() == p.ds_numel for p in params) and torch.equal(digest(params), read)
        partitioned = not any(p.numel() for p in params) and torch.equal(read, digest([p.ds_tensor for p in params]))
        collectives = Collectives()
        per_step = []
        loop.calls_at_steps = []
        loop.transformer.optimizer.optimizer.register_step_pre_hook(lambda *_: per_step.append(collectives.take()))
        start = loop.partitions()
        rewards = [loop.step() for _ in range(2)]
        collectives.restore()
    told = [str(w.message) for w in caught if issubclass(w.category, leancompile.NothingServedWarning)]
    runtime = loop.wrapped.__dict__.get("_leancompile_runtime") if where else None
    served = [[(r.action, r.kind) for r in records if r.action in ("served", "recomputed")]
              for records in loop.calls_at_steps]
    return dict(change=loop.partitions() - start, rewards=rewards, told=told, collectives=per_step,
                stats=loop.wrapped.stats() if where else {}, moved=not torch.equal(digest(params), read),
                gathered=gathered, partitioned=partitioned, served=served,
                per_block=runtime is not None and isinstance(runtime.engine, RegionalEngine),
                stepped=runtime is not None and runtime.served_ever)  # the optimizer-step watch saw served calls


def _worker(rank, port, cases, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {case: _run(where, leaves) for case, where, leaves in cases}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _close(change, native, tolerance):
    return float((change - native).norm() / native.norm()) <= tolerance


@pytest.mark.parametrize("where, leaves", [("after", "call"), ("before", "config")])
def test_zero3_with_leaf_blocks_is_served_per_block(tmp_path, where, leaves):
    pytest.importorskip("deepspeed")
    for rank in spawn_ranks(_worker, WORLD, tmp_path, [("native", None, leaves), ("wrapped", where, leaves)]):
        native, wrapped = rank["native"], rank["wrapped"]
        assert native["change"].norm() > 0
        assert wrapped["per_block"] and wrapped["stepped"] and not wrapped["told"], wrapped["told"]
        assert _close(wrapped["change"], native["change"], FLOAT32)
        assert wrapped["rewards"][0] == native["rewards"][0]  # the first rollout runs natively
        assert sum(wrapped["rewards"], []) == pytest.approx(sum(native["rewards"], []), rel=FLOAT32)
        assert wrapped["collectives"] == native["collectives"] and len(native["collectives"]) == 4
        assert all(all(step) for step in native["collectives"]), native["collectives"]
        # block calls with grad per optimizer step: the first after each rollout all served, the second all
        # recomputed (ZeRO-3's optimizer wrote the partitions, which the digest sees)
        steps = wrapped["served"]
        windows = [later[len(earlier):] for earlier, later in zip([[]] + steps, steps)]
        assert len(windows) == 4 and all(windows), windows
        for i, window in enumerate(windows):
            assert all(action == ("served" if i % 2 == 0 else "recomputed") for action, _ in window), (i, window)
            assert i % 2 == 0 or {kind for _, kind in window} <= {"weights", "written"}, (i, window)
        assert wrapped["stats"]["served_calls"] == sum(len(w) for w in windows[::2])
        for run in (native, wrapped):  # the partition read, whatever is gathered; an optimizer step seen
            assert run["gathered"] and run["partitioned"] and run["moved"]


def test_zero3_without_leaf_blocks_runs_natively_exactly_and_says_why(tmp_path):
    pytest.importorskip("deepspeed")
    for rank in spawn_ranks(_worker, WORLD, tmp_path, [("native", None, None), ("wrapped", "after", None)]):
        native, wrapped = rank["native"], rank["wrapped"]
        assert native["change"].norm() > 0
        assert wrapped["change"].equal(native["change"])  # natively: bitwise ZeRO-3's
        assert wrapped["rewards"] == native["rewards"]
        assert wrapped["collectives"] == native["collectives"]
        assert wrapped["told"] and all("set_z3_leaf_modules" in told for told in wrapped["told"]), wrapped["told"]
        assert wrapped["stats"]["served_calls"] == 0
        assert set(wrapped["stats"]["recompute_reasons"]) == {"unsupported"}, wrapped["stats"]
