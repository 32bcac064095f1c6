"""Retain at run time: the rollout keeps the autograd graphs of the backbone calls the update will differentiate,
and the update's backward runs through them instead of re-running the forward.

The rollout's call for step i over rows R is made with grad through the partitioned backbone; its output (whose
``grad_fn`` holds the partition's saved tensors) is kept with a gradient buffer. A reusing micro-step gathers its
rows from those outputs as leaves, backpropagates its loss to them, and the leaf gradients are scattered into the
buffers. Before the first optimizer step one backward per kept call sends the summed gradient into the weights;
the graphs are then freed, and later micro-steps recompute (the weights have changed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backbones import Conditioning
from .base import Runtime, StepState
from .partition import PartitionedBackbone, SavedBytes


@dataclass
class KeptCall:
    """One rollout backbone call kept for the update."""

    rows: torch.Tensor  # sample indices, in batch order within each segment
    inputs: torch.Tensor  # the call's latent input, to verify that a reuse sees the same values
    values: torch.Tensor  # the call's output, detached (all segments)
    with_grad: torch.Tensor  # the output of the segments that need gradient, with its autograd graph
    grad: torch.Tensor | None = None


@dataclass
class RetainState(StepState):
    kept: list[KeptCall] = field(default_factory=list)
    where: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (row, step) -> (call, position)
    pending: list[tuple[torch.Tensor, list[tuple[int, int]], int]] = field(default_factory=list)
    retained_bytes: int = 0


class RetainRuntime(Runtime):
    """Executes a Retain plan for one trainer's ``backbone`` and ``trainable`` weights. ``segments`` is the row
    layout of the shared call's batch and ``grad_segments`` those the loss differentiates (from the passes)."""

    state_class = RetainState

    def __init__(self, backbone, trainable, segments: int, grad_segments: tuple[int, ...],
                 memory_budget: float = 1.0, verify_inputs: bool = True):
        super().__init__(trainable)
        # Off only when the passes matched the calls modulo casts: then the inputs differ by design.
        self.verify_inputs = verify_inputs
        self.segments = segments
        self.grad_segments = grad_segments
        self.partitioned = PartitionedBackbone(backbone, memory_budget)

    def end_step(self) -> dict:
        self.state.kept.clear()  # nothing outlives its GRPO step
        return {**super().end_step(), "retained_bytes": self.state.retained_bytes}

    # ------------------------------------------------------------------------------------------ rollout

    def rollout_call(self, step: int, rows: torch.Tensor):
        return self.kept_call(step, rows) if bool(self.trained_at(step, rows).any()) else None

    def kept_call(self, step: int, rows: torch.Tensor):
        """A callable with the backbone's signature that runs and keeps the rollout's call for ``(step, rows)``."""

        def call(x, sigma, cond: Conditioning):
            counter = SavedBytes(self.partitioned.resident)
            if len(self.grad_segments) == self.segments:
                with torch.enable_grad(), counter.counting():
                    with_grad = self.partitioned(x, sigma, cond)
                values = with_grad.detach()
            else:
                # Segments without gradient run without grad: the rollout keeps nothing for them.
                b = len(rows)
                parts, grad_parts = [], []
                for s in range(self.segments):
                    seg = torch.arange(s * b, (s + 1) * b, device=x.device)
                    args = (x[seg], sigma[seg], cond.index(seg))
                    if s in self.grad_segments:
                        with torch.enable_grad(), counter.counting():
                            grad_parts.append(self.partitioned(*args))
                        parts.append(grad_parts[-1].detach())
                    else:
                        with torch.no_grad():
                            parts.append(self.partitioned.backbone(*args))
                values = torch.cat(parts)
                with torch.enable_grad():
                    with_grad = torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0]
            state = self.state
            self.remember_weights()
            index = len(state.kept)
            state.kept.append(KeptCall(rows.cpu(), x.detach(), values, with_grad))
            state.retained_bytes += counter.total
            for position, row in enumerate(rows.tolist()):
                state.where[(row, step)] = (index, position)
            return values

        return call

    # ------------------------------------------------------------------------------------------- update

    def train_call(self, micro):
        refusal = self.reuse_refusal(micro)
        if refusal is not None:
            self.record("recompute", refusal)
            return None
        self.record("reuse", "same weights, inputs and mode as the rollout")
        return self.reused_call(micro)

    def reuse_refusal(self, micro) -> str | None:
        """Why ``micro`` cannot reuse the rollout (None if it can)."""
        refusal = self.window_refusal()
        if refusal is not None:
            return refusal
        missing = [(r, s) for r, s in zip(micro.rows.tolist(), micro.steps.tolist()) if (r, s) not in self.state.where]
        if missing:
            return f"rows/steps {missing[:3]} were not kept by the rollout"
        return None

    def reused_call(self, micro):
        """A callable with the backbone's signature that returns the kept outputs for ``micro``'s rows."""

        def call(x, sigma, cond: Conditioning):
            state = self.state
            b = len(micro.rows)
            places = [state.where[(r, s)] for r, s in zip(micro.rows.tolist(), micro.steps.tolist())]
            parts = []
            for s in range(self.segments):
                seg = []
                for call_index, position in places:
                    kept = state.kept[call_index]
                    n = len(kept.rows)
                    seg.append(kept.values[s * n + position])
                    if self.verify_inputs and not torch.equal(kept.inputs[s * n + position], x[s * b + len(seg) - 1]):
                        raise RuntimeError("leancompile: a reused backbone input differs from the rollout's; "
                                           "the rows/steps mapping is wrong (please report this)")
                part = torch.stack(seg)
                if s in self.grad_segments:
                    part = part.clone().requires_grad_()
                    state.pending.append((part, places, self.grad_segments.index(s)))
                parts.append(part)
            return torch.cat(parts)

        return call

    def after_backward(self) -> None:
        """After a micro-step's backward: move its leaves' gradients into the kept calls' buffers."""
        state = self.state
        for leaf, places, grad_segment in state.pending:
            if leaf.grad is None:
                continue
            for row_grad, (call_index, position) in zip(leaf.grad, places):
                kept = state.kept[call_index]
                if kept.grad is None:
                    kept.grad = torch.zeros_like(kept.with_grad)
                kept.grad[grad_segment * len(kept.rows) + position] += row_grad
        state.pending.clear()

    def before_optimizer_step(self) -> None:
        """One backward through every kept call that received gradient, then free them all."""
        state = self.state
        used = [k for k in state.kept if k.grad is not None]
        if used:
            torch.autograd.backward([k.with_grad for k in used], [k.grad for k in used])
        state.kept.clear()
        state.where.clear()
        super().before_optimizer_step()
