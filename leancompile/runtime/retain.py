"""Retain at run time: the rollout keeps the autograd graphs of the backbone calls the update will differentiate,
and the update's backward runs through them instead of re-running the forward.

The rollout's call for step i over rows R is made with grad through the partitioned backbone; its output (whose
``grad_fn`` holds the partition's saved tensors) is kept with a gradient buffer. A reusing micro-step gathers its
rows from those outputs as leaves, backpropagates its loss to them, and the leaf gradients are scattered into the
buffers. Before the first optimizer step one backward per kept call sends the summed gradient into the weights;
the graphs are then freed, and later micro-steps recompute (the weights have changed).
"""
from __future__ import annotations

import contextlib
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
    offloaded_bytes: int = 0
    trained_steps: list[int] = field(default_factory=list)  # epoch 0's trained steps in order (the plan's positions)


class RetainRuntime(Runtime):
    """Executes a Retain plan for one trainer's ``backbone`` and ``trainable`` weights. ``segments`` is the row
    layout of the shared call's batch and ``grad_segments`` those the loss differentiates (from the passes).

    ``steps`` is the planner's action per trained step, by position among the step's trained denoising steps:
    ``"retain"``, ``"retain@f"`` (the partition keeps a fraction f of the activations and recomputes the rest in
    the backward), ``"offload"`` (the activations wait in host memory) or ``"recompute"`` (nothing is kept; the
    update runs its forward). Positions past the list retain at ``memory_budget``.
    """

    state_class = RetainState

    def __init__(self, backbone, trainable, segments: int, grad_segments: tuple[int, ...],
                 memory_budget: float = 1.0, verify_inputs: bool = True, steps: tuple[str, ...] = (),
                 tune_matmuls: bool = True):
        super().__init__(trainable)
        self.tune_matmuls = tune_matmuls
        # Off only when the passes matched the calls modulo casts: then the inputs differ by design.
        self.verify_inputs = verify_inputs
        self.segments = segments
        self.grad_segments = grad_segments
        self.backbone = backbone
        self.steps = tuple(steps)
        self.memory_budget = memory_budget
        self._partitions: dict[float, PartitionedBackbone] = {}
        self.partitioned = self._partition(memory_budget)

    def _partition(self, fraction: float) -> PartitionedBackbone:
        """One partition per budget: the min-cut partitioner decides what to save when it compiles."""
        if fraction not in self._partitions:
            self._partitions[fraction] = PartitionedBackbone(self.backbone, fraction, tune_matmuls=self.tune_matmuls)
        return self._partitions[fraction]

    def end_step(self) -> dict:
        self.state.kept.clear()  # nothing outlives its GRPO step
        return {**super().end_step(), "retained_bytes": self.state.retained_bytes,
                "offloaded_bytes": self.state.offloaded_bytes}

    # ------------------------------------------------------------------------------------------ rollout

    def step_action(self, step: int) -> str:
        """The plan's action for denoising step ``step`` in this GRPO step."""
        state = self.state
        if not state.trained_steps and state.schedule is not None:
            state.trained_steps = sorted(set(state.schedule.flatten().tolist()))
        if step not in state.trained_steps:
            return "recompute"
        position = state.trained_steps.index(step)
        return self.steps[position] if position < len(self.steps) else f"retain@{self.memory_budget}"

    def rollout_call(self, step: int, rows: torch.Tensor):
        if not bool(self.trained_at(step, rows).any()):
            return None
        action = self.step_action(step)
        if action == "recompute":
            return None
        fraction = float(action.split("@")[1]) if "@" in action else 1.0
        return self.kept_call(step, rows, self._partition(fraction), offload=action == "offload")

    def kept_call(self, step: int, rows: torch.Tensor, partitioned: PartitionedBackbone, offload: bool = False):
        """A callable with the backbone's signature that runs and keeps the rollout's call for ``(step, rows)``."""
        saving = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload
                  else contextlib.nullcontext())

        def call(x, sigma, cond: Conditioning):
            counter = SavedBytes(partitioned.resident)
            if len(self.grad_segments) == self.segments:
                with torch.enable_grad(), saving, counter.counting():
                    with_grad = partitioned(x, sigma, cond)
                values = with_grad.detach()
            else:
                # Segments without gradient run without grad: the rollout keeps nothing for them.
                b = len(rows)
                parts, grad_parts = [], []
                for s in range(self.segments):
                    seg = torch.arange(s * b, (s + 1) * b, device=x.device)
                    args = (x[seg], sigma[seg], cond.index(seg))
                    if s in self.grad_segments:
                        with torch.enable_grad(), saving, counter.counting():
                            grad_parts.append(partitioned(*args))
                        parts.append(grad_parts[-1].detach())
                    else:
                        with torch.no_grad():
                            parts.append(partitioned.backbone(*args))
                values = torch.cat(parts)
                with torch.enable_grad():
                    with_grad = torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0]
            state = self.state
            self.remember_weights()
            index = len(state.kept)
            state.kept.append(KeptCall(rows.cpu(), x.detach(), values, with_grad))
            if offload:
                state.offloaded_bytes += counter.total
            else:
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
            planned = sorted({s for _, s in missing if self.step_action(s) == "recompute"})
            if planned:
                return f"the plan recomputes step(s) {planned}: retaining them does not fit the memory budget"
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

    def before_optimizer_step(self, syncing) -> bool:
        """One backward through every kept call that received gradient, then free them all."""
        state = self.state
        used = [k for k in state.kept if k.grad is not None]
        if used:
            with syncing:
                torch.autograd.backward([k.with_grad for k in used], [k.grad for k in used])
        state.kept.clear()
        state.where.clear()
        super().before_optimizer_step(syncing)
        return bool(used)
