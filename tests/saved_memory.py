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


def static_bytes(trainer) -> int:
    """Weights, gradients and optimizer state (allocated by now) of ``trainer``."""
    params = sum(p.numel() * p.element_size() for p in trainer.backbone.parameters())
    grads = sum(p.numel() * p.element_size() for p in trainer.trainable)
    state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    ema = sum(t.numel() * t.element_size() for t in trainer.ema or ())
    return params + grads + state + ema


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
    """Peak bytes of saved tensors alive at once, the weights (``resident``) excluded. Buffers a schedule holds
    outside autograd (Reweight's gradients) are added by the caller from the runtime's statistics."""

    resident: frozenset
    live: int = 0
    peak: int = 0

    @classmethod
    def of(cls, trainer) -> "LiveSavedTensors":
        return cls(frozenset(p.untyped_storage().data_ptr() for p in trainer.backbone.parameters()))

    @contextlib.contextmanager
    def tracking(self):
        def pack(t):
            if t.untyped_storage().data_ptr() in self.resident:
                return t
            return _Held(t, t.numel() * t.element_size(), self)

        def unpack(held):
            return held.tensor if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self
