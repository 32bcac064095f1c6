"""Measured memory of a running trainer, for checking the planner: what it keeps always, and the peak of what
autograd holds for backward passes.

On a CPU there is no allocator to ask; autograd's saved tensors are what a schedule holds between a forward and
its backward (Retain keeps them across the rollout), so their live total, tracked through
``saved_tensors_hooks`` and released when autograd drops them, is the activation memory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor


def _nbytes(t: torch.Tensor) -> int:
    """What this process holds of ``t`` (its shard, under FSDP2)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _pointer(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (a sharded parameter's: its shard's)."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def static_bytes(trainer) -> int:
    """Weights, gradients and optimizer state (allocated by now) of ``trainer``, on this rank."""
    params = sum(_nbytes(p) for p in trainer.backbone.parameters())
    grads = sum(_nbytes(p) for p in trainer.trainable)
    state = sum(_nbytes(t) for s in trainer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    ema = sum(_nbytes(t) for t in trainer.ema or ())
    reference = sum(_nbytes(p) for p in trainer.reference.parameters()) if trainer.reference is not None else 0
    return params + grads + state + ema + reference


class _Held:
    """A saved tensor, counted while autograd holds it."""

    __slots__ = ("tensor", "nbytes", "counter")

    def __init__(self, tensor, nbytes, counter):
        self.tensor, self.nbytes, self.counter = tensor, nbytes, counter
        counter.live += nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


@dataclass
class LiveSavedTensors:
    """Peak bytes of saved tensors alive at once, the backbone's weights excluded. Buffers a schedule holds
    outside autograd (Reweight's gradients) are added by the caller from the runtime's statistics."""

    backbone: torch.nn.Module
    live: int = 0
    peak: int = 0

    @classmethod
    def of(cls, trainer) -> "LiveSavedTensors":
        return cls(trainer.backbone)

    @contextlib.contextmanager
    def tracking(self):
        def pack(t):
            if isinstance(t, FakeTensor):  # a graph being traced: no memory
                return t
            # Read at each pack: FSDP2 registers a block's gathered weights for its forward only
            if _pointer(t) in {_pointer(p) for p in self.backbone.parameters()}:
                return t
            return _Held(t, t.numel() * t.element_size(), self)

        def unpack(held):
            return held.tensor if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self
