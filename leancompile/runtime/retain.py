"""Retain: a kept call keeps its saved tensors, row by row; a served call's backward runs the one-row backward of
exactly its rows on them (:mod:`leancompile.runtime.rowwise`), so it costs what native's backward of those rows
costs, and a kept call serves again while the weights are unchanged (a second epoch before any optimizer step).
With ``offload`` the saved tensors wait in host memory.
"""
from __future__ import annotations

import torch

from .engine import KeptCall, Match, ReuseEngine, Schedule


class Retain(Schedule):
    name = "retain"
    held = "retained_bytes"

    def keep(self, engine: ReuseEngine, kept: KeptCall, saved: list[torch.Tensor], action) -> None:
        per_row = kept.rowwise._programs[kept.key].per_row
        if getattr(action, "kind", "retain") == "offload":
            pin = torch.cuda.is_available()
            saved = [t.to("cpu").pin_memory() if pin and row else t.to("cpu") if row else t
                     for t, row in zip(saved, per_row)]
        kept.rows = saved
        kept.nbytes = sum(t.numel() * t.element_size() for t, row in zip(saved, per_row) if row)

    def gradients(self, engine: ReuseEngine, match: Match, cotangent: torch.Tensor) -> list[torch.Tensor]:
        total = None
        for program, calls in _by_program(match):
            kept0 = calls[0][0]
            per_row = kept0.rowwise._programs[kept0.key].per_row
            device = cotangent.device
            saved = [torch.cat([kept.rows[i][torch.tensor(rows, device=kept.rows[i].device)].to(device)
                                for kept, rows, _ in calls]) if row else kept0.rows[i]
                     for i, row in enumerate(per_row)]
            positions = torch.tensor([p for _, _, ps in calls for p in ps], device=device)
            grads = kept0.rowwise.backward(kept0.key, saved, cotangent[positions].contiguous())
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        return total


def _by_program(match: Match):
    """The match's kept calls grouped by the program that ran them (partial retention compiles one per budget)."""
    groups: dict[tuple, list] = {}
    for kept, rows, positions in match.by_call():
        groups.setdefault((id(kept.rowwise), kept.key), []).append((kept, rows, positions))
    return list(groups.items())
