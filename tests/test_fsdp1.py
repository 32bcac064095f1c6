"""FSDP1 (``FullyShardedDataParallel``) in DanceGRPO's ``train_grpo_flux.py`` setting, on two gloo ranks: FULL_SHARD
(and SHARD_GRAD_OP) with an auto-wrap policy per Flux block, ``use_orig_params=True``, non-reentrant activation
checkpointing on every block, the rollout in ``eval()`` under ``no_grad`` one sample per call, the update in
``train()``, FSDP's ``clip_grad_norm_`` and two optimizer steps per rollout. ``leancompile.wrap`` of the FSDP1 root
(or of the transformer before FSDP1 wraps it) serves it per block: each block's forward inside its unit is routed to
the block's engine while FSDP1's own forward gathers and frees around it. Per served setting (the strategy,
FlowGRPO's ``MixedPrecision`` one dtype down, wrapped before FSDP1, checkpoint wrappers around the units,
``use_orig_params=False``) the weights after two GRPO steps are FSDP1 alone's to float64 rounding (float32's under
mixed precision), every update call before a rollout's first optimizer step is served, and FSDP1 runs as many
all-gathers and reduce-scatters per optimizer step as natively. NO_SHARD runs natively, exactly, and says why (CPU
offload is refused too, but FSDP1's CPU offload needs an accelerator, so it is not run here). FSDP1's
``clip_grad_norm_`` computes its local norm in float32, which fails on float64 sharded gradients (torch 2.13): the
workers compute it in the gradients' dtype."""
import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import leancompile
from conftest import spawn_ranks
from test_loops_dancegrpo import PerSampleSteps
from examples import dancegrpo_flux
from leancompile.runtime.regional import RegionalEngine

WORLD = 2
CONFIG = dancegrpo_flux.Config(num_steps=4, dtype=torch.float64)


class FSDP1Flux(PerSampleSteps, dancegrpo_flux.Loop):
    """The example's Flux loop with its transformer in FSDP1 and activation checkpointing, wrapped by leancompile
    ``where`` (``None``: not wrapped)."""

    def __init__(self, config, where, use_orig_params=True, strategy="FULL_SHARD", param_dtype=None,
                 checkpointed="inside"):
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        super().__init__(config, use_leancompile=False)
        blocks = (FluxTransformerBlock, FluxSingleTransformerBlock)
        transformer = self.transformer
        transformer.disable_gradient_checkpointing()  # the checkpoint wrappers below take its place
        checkpointing = functools.partial(
            apply_activation_checkpointing, check_fn=lambda m: isinstance(m, blocks),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        if checkpointed == "outside":  # each checkpoint wrapper then holds its block's unit
            checkpointing(transformer)
        if where == "before":
            transformer = leancompile.wrap(transformer)
        # FlowGRPO's MixedPrecision, one dtype down (float64 parameters gathered and computed in float32)
        precision = None if param_dtype is None else MixedPrecision(
            param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, param_dtype),
            buffer_dtype=getattr(torch, param_dtype))
        transformer = FullyShardedDataParallel(
            transformer, auto_wrap_policy=ModuleWrapPolicy(set(blocks)),
            sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=use_orig_params,
            mixed_precision=precision, device_id=torch.device("cpu"))
        if checkpointed == "inside":  # each unit holds its block's checkpoint wrapper
            checkpointing(transformer)
        if where == "after":
            transformer = leancompile.wrap(transformer)
        self.transformer = transformer
        self.wrapped = transformer.module if where == "before" else transformer if where else None
        # Plain SGD: Adam's first steps are sign-like and would hide a gradient's difference.
        self.optimizer = torch.optim.SGD(transformer.parameters(), lr=0.05)
        self.calls_at_steps = []  # the wrapper's block-call records made before each optimizer step
        self.optimizer.register_step_pre_hook(lambda *_: self.calls_at_steps.append(self.records()))

    def records(self) -> list:
        if self.wrapped is None:
            return []
        return list(self.wrapped.last_calls)

    def step(self):
        self.transformer.eval()
        samples = self.rollout()
        rewards = -((samples["latents"][:, -1] - self.target) ** 2).mean(dim=(1, 2))
        self.transformer.train()
        self.train(samples, rewards)
        return float(rewards.mean())


# FSDP1's collectives on CPU tensors (torch.distributed's, which FSDP1 calls by attribute): its all-gather of a
# flat parameter and its reduce-scatter of a flat gradient
COLLECTIVES = ("all_gather", "reduce_scatter_single")


class Collectives:
    """Counts FSDP1's all-gathers and reduce-scatters."""

    def __init__(self):
        self.counts = dict.fromkeys(COLLECTIVES, 0)
        for name in self.counts:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> tuple:
        taken = tuple(self.counts.values())
        self.counts = dict.fromkeys(self.counts, 0)
        return taken


def _run(where, **settings):
    config = dancegrpo_flux.Config(num_steps=CONFIG.num_steps, dtype=CONFIG.dtype, seed=dist.get_rank())
    loop = FSDP1Flux(config, where, **settings)
    collectives = Collectives()
    per_step = []
    loop.optimizer.register_step_pre_hook(lambda *_: per_step.append(collectives.take()))
    weights = lambda: torch.cat([p.detach().flatten() for p in loop.transformer.parameters()])  # noqa: E731
    start = weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewards = [loop.step() for _ in range(2)]
    change = weights() - start
    stats = loop.wrapped.stats() if where else {}
    per_block = bool(where) and isinstance(loop.wrapped.__dict__["_leancompile_runtime"].engine, RegionalEngine) \
        if where and "_leancompile_runtime" in loop.wrapped.__dict__ else False
    told = [str(w.message) for w in caught if issubclass(w.category, leancompile.NothingServedWarning)]
    served = [[(r.action, r.kind) for r in records if r.action in ("served", "recomputed")]
              for records in loop.calls_at_steps]
    return dict(rewards=rewards, change=change, stats=stats, per_block=per_block, told=told, served=served,
                collectives=per_step)


def _norm_in_float64(params, norm_type, zero, device):
    """FSDP1's local gradient norm, in the gradients' dtype: its own forces float32, which ``vector_norm`` refuses
    for float64 gradients (torch 2.13), so FSDP1's ``clip_grad_norm_`` fails on sharded float64 parameters."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return zero
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                    norm_type).to(device)


def _worker(rank, port, cases, out):
    from torch.distributed.fsdp import fully_sharded_data_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    fully_sharded_data_parallel._get_grad_norm = _norm_in_float64
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    results = {}
    for case, where, settings in cases:
        results[case] = _run(where, **settings)
        for name, original in originals.items():
            setattr(dist, name, original)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _close(change, native, tolerance):
    return float((change - native).norm() / native.norm()) <= tolerance


FLOAT64 = 1e-10  # float64's rounding of the trained weights' change
# Each served setting: where leancompile.wrap goes, FSDP1Flux's settings, and how close the trained weights are to
# FSDP1 alone's (float32's rounding where FSDP1 computes in float32, whose epsilon is 1.2e-7)
SERVED = {
    "FULL_SHARD": ("after", {}, FLOAT64),
    "SHARD_GRAD_OP": ("after", {"strategy": "SHARD_GRAD_OP"}, FLOAT64),
    "mixed precision": ("after", {"param_dtype": "float32"}, 1e-6),
    "wrapped before FSDP1": ("before", {}, FLOAT64),
    "checkpoint wrappers outside the units": ("after", {"checkpointed": "outside"}, FLOAT64),
    "use_orig_params=False": ("after", {"use_orig_params": False}, FLOAT64),
}


@pytest.mark.parametrize("variant", list(SERVED))
def test_fsdp1_is_served_per_block(tmp_path, variant):
    where, settings, tolerance = SERVED[variant]
    cases = [("native", None, settings), ("wrapped", where, settings)]
    for rank in spawn_ranks(_worker, WORLD, tmp_path, cases):
        native, wrapped = rank["native"], rank["wrapped"]
        assert native["change"].norm() > 0
        assert wrapped["per_block"]
        assert _close(wrapped["change"], native["change"], tolerance)
        # the first rollout runs natively; the second on the trained weights, bitwise FSDP1 alone's in float64
        assert wrapped["rewards"][0] == native["rewards"][0]
        assert wrapped["rewards"] == (native["rewards"] if tolerance == FLOAT64
                                      else pytest.approx(native["rewards"], rel=tolerance))
        assert wrapped["collectives"] == native["collectives"] and len(native["collectives"]) == 4
        assert all(gathers and scatters for gathers, scatters in native["collectives"]), native["collectives"]
        assert not wrapped["told"], wrapped["told"]
        # block calls with grad per optimizer step: the first after each rollout all served, the second all
        # recomputed (the weights changed)
        steps = wrapped["served"]
        windows = [later[len(earlier):] for earlier, later in zip([[]] + steps, steps)]
        assert len(windows) == 4 and all(windows), windows
        for i, window in enumerate(windows):
            assert all(action == ("served" if i % 2 == 0 else "recomputed") for action, _ in window), (i, window)
            assert i % 2 == 0 or {kind for _, kind in window} == {"weights"}, (i, window)
        assert wrapped["stats"]["served_calls"] == sum(len(w) for w in windows[::2])


# Each setting still run natively: FSDP1Flux's settings (wrapped after FSDP1) and what its warning names
REFUSED = {"NO_SHARD": ({"strategy": "NO_SHARD"}, "sharding_strategy=NO_SHARD")}


def test_fsdp1_settings_not_served_yet_run_natively_and_say_why(tmp_path):
    cases = [case for name, (settings, _) in REFUSED.items()
             for case in ((f"native {name}", None, settings), (name, "after", settings))]
    for rank in spawn_ranks(_worker, WORLD, tmp_path, cases):
        for case, (_, reason) in REFUSED.items():
            wrapped, native = rank[case], rank[f"native {case}"]
            assert not wrapped["per_block"] or wrapped["stats"]["served_calls"] == 0
            assert wrapped["change"].equal(native["change"]), case  # natively: bitwise FSDP1's
            assert wrapped["collectives"] == native["collectives"]
            assert wrapped["told"] and all(reason in told for told in wrapped["told"]), wrapped["told"]
            assert set(wrapped["stats"]["recompute_reasons"]) == {"unsupported"}, wrapped["stats"]
