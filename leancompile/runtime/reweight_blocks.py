"""Reweight per transformer block (:mod:`.regional`, FSDP2's gathers kept).

The heads' cotangents reach each block's kept call through the module's own autograd graph: a head's backbone call
is answered block by block with the kept outputs inside an autograd function (:class:`BlockProvisional`) whose
backward runs the block's one-row backward on the kept rows, keeps the per-row gradients of the block's weights
and inputs, and passes the inputs' gradients on to the blocks before it. At the backbone's output each head's
cotangent is recorded; a served backbone call's cotangent is checked there against them
(:class:`~.reweight.Coefficients`), and every block's served backward combines its rows' gradients with those
coefficients, exact by linearity.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .reweight import ProvisionalRows
from .store import KeptCall, Match, RowPick


@dataclass
class Heads:
    """The provisional heads of a module run per block: how many, and which one is being backpropagated."""

    count: int
    current: int = 0
    # The backbone calls whose rows' cotangents these heads record: those a head reached first in this run (a call
    # backpropagated by an earlier run keeps the basis its blocks' gradients were made from)
    recording: set = field(default_factory=set)


class BlockProvisional:
    """One block engine's provisional backward under a module's loss heads (see the module's docstring): answers
    the block's calls with grad during the heads, and keeps, per kept call and head, the per-row gradients of its
    weights and inputs that each row's cotangent gave."""

    def __init__(self, engine, calls: list[KeptCall], heads: Heads, gathers: bool = False):
        self.engine, self.heads = engine, heads
        self.pending = {id(kept): kept for kept in calls
                        if kept.rowwise is not None and not isinstance(kept.rows, ProvisionalRows)}
        # id(kept) -> head -> (per-parameter gradients, {input position: gradients}), each (rows, ...)
        self.received: dict[int, dict[int, tuple]] = {}
        self.gathers = gathers  # FSDP2: the heads' forward skipped the block's hooks; its backward gathers it here

    def answer(self, token: torch.Tensor):
        """What the block engine returns for a call under the heads: the kept output, joined to the module's graph
        through the call's inputs that require grad and ``token`` (a leaf every head differentiates, so that a
        block whose inputs do not require grad, the first, is reached too)."""
        def answer(match: Match, call) -> torch.Tensor:
            tensors = call.tensors
            inputs = tuple(i for i, t in enumerate(tensors) if t.requires_grad)
            return _ProvisionalBlock.apply(self, match, inputs, token, *(tensors[i] for i in inputs))
        return answer

    def backward(self, match: Match, cotangent: torch.Tensor, inputs: tuple[int, ...]) -> list:
        """Run the kept rows' one-row backward on the current head's ``cotangent``, keep what it gives per row, and
        return the gradients of the call's tensors at ``inputs`` (None: the rows were not pending)."""
        with self._gathered():
            return self._backward(match, cotangent, inputs)

    @contextlib.contextmanager
    def _gathered(self):
        """The block's whole weights for its one-row backward, where FSDP2's own hooks did not gather them."""
        if not self.gathers:
            yield
            return
        self.engine.backbone.unshard()
        try:
            yield
        finally:
            self.engine.backbone.reshard()

    def _backward(self, match: Match, cotangent: torch.Tensor, inputs: tuple[int, ...]) -> list:
        head, device, total = self.heads.current, cotangent.device, len(match.places)
        grads_in: dict[int, torch.Tensor] = {}
        for kept, rows, positions in match.by_call():
            if id(kept) not in self.pending:
                continue  # backpropagated by an earlier run: its rows keep what they have (rows are independent)
            program = kept.rowwise.program_of(kept.key)
            pick, here = RowPick(rows), RowPick(positions)
            saved = [pick.of(t).contiguous() for t in kept.rows]
            cot = here.of(cotangent).contiguous()
            out = kept.rowwise.backward(kept.key, saved, cot, per_row=True)
            params = out[:len(program.trainable)]
            per_input = dict(zip(program.input_grads, out[len(program.trainable):]))
            rows_kept = len(kept.output)
            index = torch.tensor(rows, device=device)
            record = self.received.setdefault(id(kept), {}).get(head)
            if record is None:
                whole = rows == list(range(rows_kept))
                record = ([g if whole else _placed(g, index, rows_kept) for g in params],
                          {i: g if whole else _placed(g, index, rows_kept) for i, g in per_input.items()})
                self.received[id(kept)][head] = record
            else:  # another call of the same head reached other rows of this kept call
                for mine, g in zip(record[0], params):
                    mine.index_add_(0, index, g)
                for i, g in per_input.items():
                    record[1][i].index_add_(0, index, g)
            where = torch.tensor(positions, device=device)
            for i in inputs:
                if i in per_input:
                    grad = per_input[i]
                    if i not in grads_in:
                        grads_in[i] = grad.new_zeros((total, *grad.shape[1:]))
                    grads_in[i].index_copy_(0, where, grad)
        return [grads_in.get(i) for i in inputs]

    def settle(self) -> None:
        """Once every head has run: each pending call keeps its per-row gradients in place of its saved tensors,
        per head (None for a head that did not reach it); a call no head reached (a step no update trains) is
        freed."""
        untouched = []
        for key, kept in self.pending.items():
            received = self.received.get(key, {})
            if not received:
                untouched.append(kept)
                continue
            first = next(iter(received.values()))
            heads = [received.get(h) for h in range(self.heads.count)]
            positions = set.intersection(*(set(record[1]) for record in received.values()))
            ProvisionalRows.settle(self.engine, kept, None, [r[0] if r else [None] * len(first[0]) for r in heads],
                                   {i: tuple(r[1][i] if r else None for r in heads) for i in sorted(positions)})
        self.engine.forget(untouched)
        self.pending, self.received = {}, {}


def _placed(rows: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    """``rows`` at rows ``index`` of zeros of ``total`` rows."""
    return rows.new_zeros((total, *rows.shape[1:])).index_copy_(0, index, rows)


class _ProvisionalBlock(torch.autograd.Function):
    """A block call under a provisional head: its output is the kept values; its backward is the kept rows'."""

    @staticmethod
    def forward(ctx, recorder, match, inputs, token, *tensors):
        ctx.recorder, ctx.match, ctx.inputs = recorder, match, inputs
        return match.gather()

    @staticmethod
    def backward(ctx, cotangent):
        grads = ctx.recorder.backward(ctx.match, cotangent, ctx.inputs)
        return (None, None, None, None, *grads)
