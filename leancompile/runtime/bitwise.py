"""Bitwise Retain: native's own kernels in both phases, so the run is native's to the bit (float32 and bf16 alike).

The per-row program (:mod:`.retain`) is exact in real arithmetic, but its kernels (a vmapped one-row partition,
matrix products reassociated, gradients summed per row) round differently from the eager kernels native runs, so
in float32 or bf16 a run drifts from native's. Here a kept call runs the module itself, eagerly, with grad enabled
(autocast as the caller set it; activation checkpointing off), and keeps that call's autograd graph. The rollout
gets the forward's values: native's no-grad forward computes the same bits with the same kernels. A served call
backpropagates the kept graph: the backward native's update runs after its own identical forward, on the same
values, in the same order.

Native's gradient depends on the batch it backpropagates (a weight's gradient sums over the batch's rows in one
matrix product), so a call is served only when it holds exactly one kept call's rows in their order (a rollout
batch equal to the update's micro-batch, e.g. DanceGRPO's one sample per call); any other grouping recomputes
natively, counted under the kind ``batch``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..backbones.checkpointing import without_checkpointing
from .calls import Call, output_layout
from .schedule_runtime import ScheduleRuntime
from .store import KeptCall, Match


@dataclass
class KeptGraph:
    output: torch.Tensor  # the eager forward's output, its autograd graph attached
    nbytes: int  # what the graph holds besides the weights


class BitwiseRetain(ScheduleRuntime):
    name = "retain, bitwise"
    held = "retained_bytes"

    def __init__(self):
        self._verdicts: dict[tuple, str | None] = {}  # per compile key: why its forward with grad is not native's

    def refusal(self, engine, key: tuple, call: Call) -> str | None:
        """Once per compile key: the module's forward with grad must give its forward without grad's bits. Some
        kernels are chosen by grad mode (matmul folds a batch into one matrix product when a weight requires grad,
        and where the input's strides allow it otherwise), and then the rollout native runs is not the one a kept
        graph would give."""
        if key not in self._verdicts:
            with torch.no_grad():
                without, _, _ = output_layout(engine.native(*call.args, **call.kwargs))
            with torch.enable_grad(), without_checkpointing(engine.backbone):
                with_grad, _, _ = output_layout(engine.native(*call.args, **call.kwargs))
            self._verdicts[key] = None if torch.equal(without, with_grad.detach()) else (
                "bitwise: its forward with grad runs other kernels than without (not native's rollout bits)")
        return self._verdicts[key]

    def forward(self, engine, rowwise, key: tuple, call: Call) -> tuple[torch.Tensor, list]:
        weights = {p.untyped_storage().data_ptr() for p in rowwise.weights}
        saved: dict[int, int] = {}
        with torch.enable_grad(), without_checkpointing(engine.backbone), \
                torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, weights, saved), _unpack):
            output, _, _ = output_layout(engine.native(*call.args, **call.kwargs))
        return output.detach(), [KeptGraph(output, sum(saved.values()))]

    @staticmethod
    def pack(weights: set, saved: dict, t: torch.Tensor) -> torch.Tensor:
        """Counts what the graph holds (activations, not the weights it saves as views); returns ``t`` detached: an
        operator's own output saved with its grad_fn would hold that node, a reference cycle through C++ that no
        collector frees (the graph would leak)."""
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    def keep(self, engine, kept: KeptCall, saved: list, action) -> None:
        kept.rows = saved[0]
        kept.nbytes = saved[0].nbytes

    def claim(self, match: Match) -> tuple[str, str] | None:
        groups = match.by_call()
        kept, rows, positions = groups[0]
        whole = list(range(len(kept.output)))
        if len(groups) != 1 or rows != whole or positions != whole:
            return ("its rows are not exactly one kept call's rows in their order (native's gradient depends on "
                    "the batch)", "batch")
        return None

    def gradients(self, engine, match: Match, cotangent: torch.Tensor, inputs: tuple[int, ...] = (),
                  context=None) -> list:
        kept = match.places[0][0]
        # retain_graph: a second epoch before any optimizer step backpropagates it again (native recomputes the
        # same forward then). Parameters the graph does not reach get no gradient, as in native's backward.
        return list(torch.autograd.grad(kept.rows.output, engine.trainable(match), cotangent, retain_graph=True,
                                        allow_unused=True))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
