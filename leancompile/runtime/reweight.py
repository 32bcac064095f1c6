"""Reweight: right after a kept call's step, the trainer's own loss head runs on the kept output at provisional
advantages (1, and 0 when the loss has advantage-free terms such as a KL penalty), and the one-row backward of
every row (:mod:`leancompile.runtime.rowwise`) turns those cotangents into per-row gradients of every trainable
parameter; the saved tensors are then freed.

A served call's backward receives the loop's true cotangent ``g``. Per row it must lie in the span of the row's
provisional cotangents ``c_k`` (the run-time proof that the ratio is 1 and the loss linear in what the row
receives): ``g = sum_k a_k c_k`` up to rounding. The gradient is then ``sum_k a_k P_k`` from the row's provisional
gradients ``P_k``, exact by linearity of the backward. A row serves one call with grad (a second use recomputes);
a cotangent outside the span makes the call recompute natively, forward and backward, in that backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import KeptCall, Match, ReuseEngine, ScheduleRuntime


@dataclass
class ProvisionalRows:
    """One kept call's provisional work, row by row."""

    cotangents: torch.Tensor  # (rows, k, *output) the provisional cotangents backpropagated
    gradients: list[tuple[torch.Tensor, ...]]  # per trainable parameter, per cotangent: (rows, *shape)
    used: torch.Tensor  # (rows,) bool: served to a call with grad already


def span_tolerance(dtype: torch.dtype) -> float:
    """The residual, relative to the cotangent, that rounding alone can leave (two heads on the same values)."""
    return 1024 * torch.finfo(dtype).eps


class Reweight(ScheduleRuntime):
    name = "reweight"
    held = "buffer_bytes"

    def __init__(self, advantage_free: bool = True):
        # The provisional advantages the heads run at: 0 as well only where the traced loss has advantage-free
        # terms. A loop whose loss has them after all gets cotangents outside the span, which recompute.
        self.advantages = (1.0, 0.0) if advantage_free else (1.0,)

    def keep(self, engine: ReuseEngine, kept: KeptCall, saved: list[torch.Tensor], action) -> None:
        kept.rows = saved  # until its provisional heads have run

    def provisional(self, engine: ReuseEngine, calls: list[KeptCall], heads) -> None:
        """Backpropagate ``heads`` (callables returning the trainer's loss on the kept output) through ``calls``.

        Each head's backbone calls are answered with leaves of the kept values; the heads' cotangents on them form
        each row's basis (the first minus the last, and the last, when several heads share advantage-free terms)."""
        cotangents = {id(kept): [] for kept in calls}
        for head in heads:
            with engine.answering_with_leaves() as leaves:
                loss = head()
            for kept in calls:
                cotangents[id(kept)].append(torch.zeros_like(kept.output))
            if not leaves or not loss.requires_grad:
                continue
            grads = torch.autograd.grad(loss, [leaf for _, leaf in leaves], allow_unused=True, materialize_grads=True)
            for (match, _), grad in zip(leaves, grads):
                for kept, rows, positions in match.by_call():
                    if id(kept) in cotangents:
                        device = grad.device
                        cotangents[id(kept)][-1][torch.tensor(rows, device=device)] += \
                            grad[torch.tensor(positions, device=device)]
        untouched = []
        for kept in calls:
            heads_cot = cotangents[id(kept)]
            basis = [heads_cot[0] - heads_cot[-1], heads_cot[-1]] if len(heads_cot) > 1 else heads_cot
            if len(basis) > 1 and not bool(basis[1].any()):
                basis = basis[:1]
            # No head reached it (a step no update trains): no backward, freed.
            if not any(bool(b.any()) for b in basis):
                untouched.append(kept)
                continue
            grads = [kept.rowwise.backward(kept.key, kept.rows, c.to(kept.output.dtype), per_row=True) for c in basis]
            # Kept as the backward made them: stacking the cotangents' gradients copied every row of every parameter
            # (full fine-tuning under FlowGRPO's KL: most of the step's time)
            kept.rows = ProvisionalRows(torch.stack(basis, dim=1), list(zip(*grads)),
                                        torch.zeros(len(kept.output), dtype=torch.bool, device="cpu"))  # host flags
            nbytes = sum(t.numel() * t.element_size()
                         for t in (kept.rows.cotangents, *(g for per_basis in kept.rows.gradients for g in per_basis)))
            engine._count(nbytes - kept.nbytes)
            kept.nbytes = nbytes
        engine.forget(untouched)

    def available(self, kept: KeptCall, row: int) -> bool:
        # Two samples can be equal (an LLM's group often holds the same completion twice): each has its own row.
        return not (isinstance(kept.rows, ProvisionalRows) and bool(kept.rows.used[row]))

    def claim(self, match: Match) -> tuple[str, str] | None:
        places = [(kept.rows, row) for kept, row in match.places]
        if not all(isinstance(rows, ProvisionalRows) for rows, _ in places):
            return "the rollout did not backpropagate these rows", "used"
        if any(bool(rows.used[row]) for rows, row in places):
            return "a row's provisional gradient was already used by an earlier call", "used"
        for rows, row in places:
            rows.used[row] = True
        return None

    def gradients(self, engine: ReuseEngine, match: Match, cotangent: torch.Tensor,
                  inputs: tuple[int, ...] = ()) -> list[torch.Tensor] | None:
        groups = [(kept.rows, torch.tensor(rows, device=cotangent.device), torch.tensor(positions, device=cotangent.device))
                  for kept, rows, positions in match.by_call()]
        order = torch.cat([positions for _, _, positions in groups])  # this call's rows, grouped by kept call
        basis = torch.cat([rows.cotangents[index] for rows, index, _ in groups]).double().flatten(2)  # (rows, k, n)
        g = cotangent[order].double().flatten(1)  # (rows, n)
        gram = basis @ basis.transpose(1, 2)
        coefficients = (torch.linalg.pinv(gram) @ (basis @ g.unsqueeze(2))).squeeze(2)  # (rows, k)
        residual = g - (coefficients.unsqueeze(2) * basis).sum(1)
        bound = span_tolerance(cotangent.dtype) * g.norm(dim=1)
        if not bool((residual.norm(dim=1) <= bound).all()):
            return None
        # Each parameter's gradient is a matrix-vector product over the rows' provisional gradients, read in place
        # run by run of consecutive kept rows: gathering them first copied every row twice.
        runs, offset = [], 0
        for provisional, index, _ in groups:
            for start, stop in _consecutive(index.tolist()):
                runs.append((provisional, start, stop, coefficients[offset:offset + stop - start]))
                offset += stop - start
        grads = []
        for i in range(len(groups[0][0].gradients)):
            total = None
            for provisional, start, stop, weights in runs:
                for basis_rows, basis_weights in zip(provisional.gradients[i], weights.t()):
                    rows = basis_rows[start:stop]  # (run, *shape)
                    matrix, vector = rows.reshape(stop - start, -1).t(), basis_weights.to(rows.dtype)
                    total = torch.mv(matrix, vector) if total is None else total.addmv_(matrix, vector)
            grads.append(total.view(rows.shape[1:]))
        return grads


def _consecutive(rows: list[int]) -> list[tuple[int, int]]:
    """``rows`` as ``[start, stop)`` runs of consecutive indices, in order."""
    runs = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    return [tuple(run) for run in runs]
