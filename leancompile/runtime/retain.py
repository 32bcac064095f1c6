"""Retain: a kept call keeps its saved tensors, row by row; a served call's backward runs the one-row backward of
exactly its rows on them (:mod:`leancompile.runtime.rowwise`), so it costs what native's backward of those rows
costs, and a kept call serves again while the weights are unchanged (a second epoch before any optimizer step).
With ``offload`` the saved tensors wait in host memory.

Rows the plan proves carry no gradient (a detached CFG branch: ``pruned`` segments of the call's batch) keep no
saved tensors. Their cotangent must then be zero when served; a loop whose cotangent there is not zero gets
those calls recomputed natively in the backward, never a different gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import Action
from .schedule_runtime import ScheduleRuntime
from .store import KeptCall, Match, RowPick


@dataclass
class RetainedRows:
    saved: list[torch.Tensor]  # the program's per-row saved tensors, rows on dimension 0
    position: list[int]  # per row of the call: its row in ``saved`` (-1: pruned, nothing kept)


class Retain(ScheduleRuntime):
    name = "retain"
    held = "retained_bytes"
    input_gradients = True  # the per-row backward returns each row's input gradient too (blocks: see .regional)

    def __init__(self, segments: int = 1, pruned: tuple[int, ...] = ()):
        self.segments = segments
        self.pruned = tuple(pruned)

    def for_block(self) -> "Retain":
        return Retain(self.segments, self.pruned)

    def keep(self, engine, kept: KeptCall, saved: list[torch.Tensor], action) -> None:
        rows = len(kept.output)
        keep = list(range(rows))
        if self.pruned and rows % self.segments == 0:
            keep = [r for r in keep if r // (rows // self.segments) not in self.pruned]
        if len(keep) < rows:
            pick = RowPick(keep)
            saved = [pick.of(t) for t in saved]
        if action.kind is Action.OFFLOAD:
            pin = torch.cuda.is_available()
            saved = [t.to("cpu").pin_memory() if pin else t.to("cpu") for t in saved]
        position = [-1] * rows
        for i, r in enumerate(keep):
            position[r] = i
        kept.rows = RetainedRows(saved, position)
        kept.nbytes = sum(t.numel() * t.element_size() for t in saved)

    def gradients(self, engine, match: Match, cotangent: torch.Tensor,
                  inputs: tuple[int, ...] = (), context=None) -> list[torch.Tensor] | None:
        device, total = cotangent.device, None
        rows_total = len(match.places)
        input_grads: dict[int, torch.Tensor] = {}
        for calls in _by_program(match):
            kept0 = calls[0][0]
            program = kept0.rowwise.program_of(kept0.key)
            parts, positions = [], []  # per kept call: the rows of its saved tensors, and where they sit in the call
            for kept, kept_rows, call_positions in calls:
                held = [(kept.rows.position[r], p) for r, p in zip(kept_rows, call_positions)]
                pruned = [p for r, p in held if r < 0]
                if pruned and bool(cotangent[torch.tensor(pruned, device=device)].any()):
                    return None  # a pruned row receives gradient after all: recompute natively
                held = [(r, p) for r, p in held if r >= 0]
                if held:
                    parts.append((kept, [r for r, _ in held]))
                    positions += [p for _, p in held]
            if not parts:
                continue
            # One pick per kept call (a slice where its rows are consecutive), then one gather per saved tensor.
            picks = [RowPick(rows) for _, rows in parts]
            saved = []
            for i in range(len(kept0.rows.saved)):
                pieces = [pick.of(kept.rows.saved[i]) for (kept, _), pick in zip(parts, picks)]
                # Contiguous, as the graphs were traced on (a slice of a transposed tensor is not).
                gathered = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)
                saved.append(gathered if gathered.device == device else gathered.to(device))
            pick = RowPick(positions)
            grads = kept0.rowwise.backward(kept0.key, saved, pick.of(cotangent).contiguous())
            params = grads[:len(program.trainable)]
            per_input = dict(zip(program.input_grads, grads[len(program.trainable):]))
            total = params if total is None else [a + b for a, b in zip(total, params)]
            for i in inputs:  # each row's input gradient, placed at its row of the call
                grad = per_input[i]
                if i not in input_grads:
                    input_grads[i] = grad.new_zeros((rows_total, *grad.shape[1:]))
                input_grads[i].index_copy_(0, torch.tensor(positions, device=device), grad)
        if total is None:
            total = [torch.zeros_like(p) for p in engine.trainable(match)]
        # Rows with no saved tensors (pruned, their cotangent verified zero) pass zero to their inputs (None).
        return [*total, *(input_grads.get(i) for i in inputs)]


def _by_program(match: Match) -> list[list]:
    """The match's kept calls grouped by the program that ran them (partial retention compiles one per budget)."""
    groups: dict[tuple, list] = {}
    for kept, rows, positions in match.by_call():
        groups.setdefault((id(kept.rowwise), kept.key), []).append((kept, rows, positions))
    return list(groups.values())
