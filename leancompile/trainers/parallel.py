"""Data parallelism on torch.distributed: DDP or FSDP2, with the gradient synchronisation placed explicitly.

Every rank runs the trainer on its own samples; the gradient of one optimizer step is averaged across ranks once,
by the engine's own collectives:

* DDP (``DistributedDataParallel``): its reducer all-reduces bucket by bucket as the parameters' gradients are
  accumulated, in a backward it was armed for. DDP arms the reducer in its own forward; the trainer's backbone
  calls, and the graphs leancompile keeps from the rollout, run outside that forward, so :meth:`DDPSync.backward`
  arms it the way DDP's forward does, just before the backward that completes the step's gradient. Every other
  backward accumulates locally, as under ``no_sync()``.
* FSDP2 (``fully_shard`` on each transformer block and on the backbone): each sharded module reduce-scatters its
  gradients in its post-backward when ``set_requires_gradient_sync(True)``; other backwards accumulate unsharded.
  A step that leancompile rewrites runs on the whole weights instead (:meth:`FSDPSync.whole_weights`): the
  modules' ``unshard()`` gathers them into a plain copy of the backbone without FSDP's hooks, which AOTAutograd
  can trace; its gradients accumulate whole, and the sync reduce-scatters them into the shards in one collective.

  A Retain step planned per transformer block runs so instead (``per_block``, set by :func:`leancompile.optimize`;
  :mod:`leancompile.runtime.regional`): FSDP2's own hooks gather each block's weights and reduce-scatter its
  gradients, as natively. The passes trace and analyse a copy with fake whole weights
  (:meth:`FSDPSync.analysis_weights`), so compiling gathers nothing.

``backward(sync)`` is the one switch: the trainer syncs the last backward before each optimizer step. The sync
counts what it did: ``syncs`` (backwards that synchronised), ``collectives`` (DDP bucket all-reduces, FSDP
reduce-scatters) and ``gathers`` (FSDP2 weight all-gathers), so the traffic of an optimizer step can be asserted.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..backbones.plain import plain_copy, with_fake_weights


class GradientSync:
    """One process: every backward's gradient is already the step's."""

    kind = "none"

    def __init__(self):
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if self.kind != "none" else (0, 1)
        self.syncs = 0
        self.collectives = 0
        self.gathers = 0  # weight all-gathers (FSDP2)

    @contextlib.contextmanager
    def backward(self, sync: bool):
        """The context of one backward; with ``sync`` it completes the step's gradient on every rank."""
        yield

    def flush(self, parameters: list[torch.Tensor]) -> None:
        """Synchronise the gradients accumulated so far, with no backward left to carry the sync."""
        with self.backward(True):
            torch.autograd.backward(parameters, [torch.zeros_like(p) for p in parameters])

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(world_size, *tensor.shape)``: every rank's ``tensor``, in rank order."""
        if self.world_size == 1:
            return tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a (possibly sharded) parameter or gradient."""
        return tensor

    @contextlib.contextmanager
    def whole_weights(self, trainer):
        """The backbone and trainable weights a rewritten step runs on: the trainer's own (one process, DDP)."""
        yield trainer.backbone, trainer.trainable

    @contextlib.contextmanager
    def analysis_weights(self, trainer):
        """The backbone and trainable weights the passes trace and analyse (shapes, never values): the trainer's
        own (one process, DDP)."""
        yield trainer.backbone, trainer.trainable

    def weights_changed(self) -> None:
        """After an optimizer step: copies of the weights are stale."""

    def gather(self) -> None:
        """Bring the whole weights a rewritten step runs on up to date (FSDP2: gather the shards)."""

    def sources(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates when they are not the weights a step runs on (FSDP2: the shards, whose
        gather into the whole weights moves no version counter)."""
        return []


class DDPSync(GradientSync):
    kind = "ddp"

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        device = next(backbone.parameters()).device
        # Construction broadcasts rank 0's weights, so every rank starts from the same ones.
        self.ddp = DistributedDataParallel(backbone, device_ids=[device.index] if device.type == "cuda" else None)

        def counted_allreduce(state, bucket):
            self.collectives += 1
            return allreduce_hook(state, bucket)  # DDP's own: all-reduce the bucket, divided by the world size

        self.ddp.register_comm_hook(None, counted_allreduce)

    @contextlib.contextmanager
    def backward(self, sync: bool):
        if sync:
            reducer = self.ddp.reducer
            reducer.prepare_for_forward()
            reducer.prepare_for_backward([])  # as DDP's forward does with find_unused_parameters=False
            self.syncs += 1
        yield


class FSDPSync(GradientSync):
    kind = "fsdp"

    def __init__(self, backbone):
        super().__init__()
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        sync = self

        class CountedReduceScatter(DefaultReduceScatter):
            def __call__(self, *args, **kwargs):
                sync.collectives += 1
                return super().__call__(*args, **kwargs)

        class CountedAllGather(DefaultAllGather):
            def __call__(self, *args, **kwargs):
                sync.gathers += 1
                return super().__call__(*args, **kwargs)

        for _, blocks in backbone.block_stacks():
            for block in blocks:
                fully_shard(block)
        fully_shard(backbone)
        self.root = backbone
        self.root_device = next(backbone.parameters()).device
        self.sharded_modules = [m for m in backbone.modules() if isinstance(m, FSDPModule)]
        for module in self.sharded_modules:
            module.set_custom_reduce_scatter(CountedReduceScatter())
            module.set_custom_all_gather(CountedAllGather())
        self.shards = {n: p for n, p in backbone.named_parameters() if p.requires_grad}
        self.gathered = False
        self.per_block = False  # a step rewritten per transformer block keeps FSDP2's own gathers (runtime.regional)
        self._view = None  # (plain backbone, whole trainable weights), built on the first gather
        self._whole = {}  # name -> whole parameter (the module's unsharded one; FSDP2 reuses it across gathers)

    def run_per_block(self) -> None:
        """Steps run per transformer block from now on (runtime.regional): the backbone's own FSDP2 hooks gather
        each block, and the whole weights are never gathered; back to the shards now, which the engines read."""
        self.per_block = True
        self.release()

    @contextlib.contextmanager
    def backward(self, sync: bool):
        if self.gathered:  # the plain copy has no FSDP hooks: the gradients are whole until reduce-scattered here
            yield
            if sync:
                self._reduce_scatter()
            return
        self.root.set_requires_gradient_sync(sync)  # read by each module's post-backward
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)
        self.syncs += sync

    def flush(self, parameters):
        with self.backward(True):
            pass

    @contextlib.contextmanager
    def analysis_weights(self, trainer):
        """A copy of the backbone with fake whole weights: the analyses gather nothing, and a step run per block
        never holds the whole model (a schedule that runs on the whole weights gathers them when it runs)."""
        view = with_fake_weights(self.root, self.root_device)
        named = dict(view.named_parameters())
        yield view, [named[n] for n in trainer.trainable_names]

    @contextlib.contextmanager
    def whole_weights(self, trainer):
        if self.per_block:
            yield trainer.backbone, trainer.trainable
            return
        self.gather()
        if self._view is None:
            self._whole = {n: p for n, p in self.root.named_parameters() if n in self.shards}
            view = plain_copy(self.root)
            # A call after an optimizer step (which updates the shards) gathers the new weights first.
            view.register_forward_pre_hook(lambda *_: self.gather())
            self._view = view, [self._whole[n] for n in trainer.trainable_names]
        try:
            yield self._view
        finally:
            self.release()

    def sources(self):
        return list(self.shards.values())

    def gather(self) -> None:
        if not self.gathered:
            for module in self.sharded_modules:
                module.unshard()
            self.gathered = True

    def weights_changed(self) -> None:
        self.release()  # the next call through the plain copy gathers the updated shards

    def release(self) -> None:
        """Back to the shards (after an optimizer step, or at the end of a step)."""
        if self.gathered:
            for module in self.sharded_modules:
                module.reshard()
            self.gathered = False

    def _reduce_scatter(self) -> None:
        """Average the whole gradients across ranks into each rank's shards (FSDP2's dim-0 chunks), all
        parameters in one reduce-scatter."""
        from torch.distributed.tensor import DTensor

        named = [(n, p) for n, p in self._whole.items() if p.grad is not None]
        rows = [-(-p.shape[0] // self.world_size) for _, p in named]
        padded = []
        for (_, p), r in zip(named, rows):
            grad = p.grad.new_zeros((self.world_size * r, *p.shape[1:]))
            grad[:p.shape[0]] = p.grad
            padded.append(grad.view(self.world_size, -1))
        # row k: rank k's chunk of every gradient (every rank joins the collective, with or without gradients)
        flat = torch.cat(padded, dim=1) if padded else torch.zeros(self.world_size, 0, device=self.root_device)
        mine = flat.new_empty(flat.shape[1])
        dist.reduce_scatter_tensor(mine, flat.flatten())
        self.collectives += 1
        self.syncs += 1
        mine /= self.world_size
        for (name, p), part in zip(named, mine.split([g.shape[1] for g in padded])):
            shard = self.shards[name]
            local = part.view(-1, *p.shape[1:])[:shard.to_local().shape[0]]
            grad = DTensor.from_local(local.clone(), shard.device_mesh, shard.placements, shape=shard.shape,
                                      stride=shard.stride())
            shard.grad = grad if shard.grad is None else shard.grad + grad
            p.grad = None

    def full(self, tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradient_sync(engine: str, backbone: torch.nn.Module) -> GradientSync:
    """The gradient sync for ``config.parallel`` = ``engine``; wraps (DDP) or shards (FSDP2) ``backbone``."""
    if engine == "none":
        return GradientSync()
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"parallel={engine!r} needs torch.distributed initialised: launch with torchrun and call "
                         "torch.distributed.init_process_group('nccl' or 'gloo') before building the trainer, or "
                         "set parallel='none'")
    return {"ddp": DDPSync, "fsdp": FSDPSync}[engine](backbone)
