"""Reweight: right after a kept call's step, the trainer's own loss head runs on the kept output at provisional
advantages (1, and 0 when the loss has advantage-free terms such as a KL penalty), and the one-row backward of
every row (:mod:`leancompile.runtime.rowwise`) turns those cotangents into per-row gradients of every trainable
parameter; the saved tensors are then freed.

A served call's backward receives the loop's true cotangent ``g``. Per row it must lie in the span of the row's
provisional cotangents ``c_k`` (the run-time proof that the ratio is 1 and the loss linear in what the row
receives): ``g = sum_k a_k c_k`` up to rounding. The gradient is then ``sum_k a_k P_k`` from the row's provisional
gradients ``P_k``, exact by linearity of the backward. A row serves one call with grad (a second use recomputes);
a cotangent outside the span makes the call recompute natively, forward and backward, in that backward.

"Up to rounding" is the rounding of the precision the cotangents were computed in, which can be coarser than their
dtype: a loss head computing in float32 over a float64 module (TRL's log-probabilities, a FlowGRPO step's float32
log-prob over a float64 backbone) hands back float64 cotangents with float32's rounding. The coarsest floating dtype
among the ops of the heads' backward (:class:`LowestPrecision`) sets the span test's tolerance; the update's loss
is the heads' own, so its cotangent carries the same rounding, and the served gradient is exact to that precision.

Per transformer block, see :mod:`.reweight_blocks`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import StepAction
from .rowwise import Factors
from .schedule_runtime import ScheduleRuntime
from .store import Found, KeptCall, Match


@dataclass
class ProvisionalRows:
    """One kept call's provisional work, row by row."""

    # (rows, k, *output) the provisional cotangents backpropagated (None per block: a block's coefficients are found
    # at the backbone's output, see runtime.reweight_blocks.Coefficients)
    cotangents: torch.Tensor | None
    # per trainable parameter, per cotangent: (rows, *shape), or a linear layer's as its Factors where smaller
    gradients: list[tuple[torch.Tensor | Factors, ...]]
    used: torch.Tensor  # (rows,) bool: served to a call with grad already
    # per position among the call's tensors (a block's inputs), per cotangent: each row's input gradient
    inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    precision: torch.dtype | None = None  # the coarsest the cotangents were computed in (None: their dtype)
    # the parameters whose gradients are kept as Factors: their position -> the side their bases share
    factored: dict[int, str | None] = field(init=False)
    # the small dense gradients, laid side by side per dtype (``gradients`` then holds views of them)
    packs: tuple["Pack", ...] = field(init=False)

    def __post_init__(self):
        self.factored = {i: _shared_side(g) for i, g in enumerate(self.gradients)
                         if any(isinstance(f, Factors) for f in g)}
        self.packs = Pack.of(self.gradients)

    @classmethod
    def settle(cls, engine, kept: KeptCall, basis: list[torch.Tensor] | None, gradients: list[list],
               inputs: dict[int, tuple[torch.Tensor, ...]] | None = None,
               precision: torch.dtype | None = None) -> None:
        """Replace ``kept``'s saved tensors by what ``basis`` gave (per cotangent, per parameter: ``gradients``)."""
        kept.rows = cls(None if basis is None else torch.stack(basis, dim=1), list(zip(*gradients)),
                        torch.zeros(len(kept.output), dtype=torch.bool, device="cpu"), inputs or {},  # host flags
                        precision)
        # Kept as the backward made them: stacking the cotangents' gradients copied every row of every parameter
        # (full fine-tuning under FlowGRPO's KL: most of the step's time)
        held = (kept.rows.cotangents, *(g for per_basis in kept.rows.gradients for g in per_basis),
                *(g for per_basis in kept.rows.inputs.values() for g in per_basis))
        tensors = (t for g in held if g is not None for t in ((g.left, g.right) if isinstance(g, Factors) else (g,)))
        # by storage: factors share theirs (a layer's input is the right factor of each basis, of q, k and v alike)
        nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        engine.store.count(nbytes - kept.nbytes)
        kept.nbytes = nbytes


# Per-row gradients of at most this many elements a row are packed: a served call then combines all of them with
# one product per stretch and cotangent where it had made one per parameter (a bias's, a norm's: the per-op cost)
PACKED_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Pack:
    """Parameters' dense per-row gradients of one dtype and device, side by side: per cotangent a ``(rows, size)``
    buffer whose columns ``offsets[j]:offsets[j + 1]`` are parameter ``params[j]``'s, of ``shapes[j]``."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    buffers: tuple[torch.Tensor, ...]

    @property
    def layout(self) -> tuple:
        """What two kept calls' packs must share for one product to combine both."""
        return self.params, self.offsets, self.shapes, self.buffers[0].dtype, len(self.buffers)

    @classmethod
    def of(cls, gradients: list[tuple]) -> tuple["Pack", ...]:
        """Pack the small dense per-row gradients that every cotangent reached, replacing them in ``gradients`` by
        views of the packs (a copy of each: small by definition)."""
        groups: dict[tuple, list[int]] = {}
        for i, per_basis in enumerate(gradients):
            if all(type(g) is torch.Tensor for g in per_basis) and per_basis[0][0].numel() <= PACKED_ELEMENTS:
                groups.setdefault((per_basis[0].dtype, per_basis[0].device), []).append(i)
        packs = []
        for members in (m for m in groups.values() if len(m) > 1):
            shapes = tuple(gradients[i][0].shape[1:] for i in members)
            offsets = (0, *itertools.accumulate(s.numel() for s in shapes))
            buffers = tuple(torch.cat([gradients[i][k].flatten(1) for i in members], 1)
                            for k in range(len(gradients[members[0]])))
            for j, i in enumerate(members):
                gradients[i] = tuple(b[:, offsets[j]:offsets[j + 1]].unflatten(1, shapes[j]) for b in buffers)
            packs.append(cls(tuple(members), offsets, shapes, buffers))
        return tuple(packs)

    def unpacked(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each parameter's gradient as a view of ``flat``, a combination of the buffers' rows."""
        return {i: flat[self.offsets[j]:self.offsets[j + 1]].view(self.shapes[j]) for j, i in enumerate(self.params)}


def span_tolerance(dtype: torch.dtype) -> float:
    """The residual, relative to the cotangent, that rounding alone can leave (two heads on the same values)."""
    return 1024 * torch.finfo(dtype).eps


def coarsest(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """The floating dtype with the largest rounding among ``dtypes`` (None ignored; None if all are)."""
    return max((d for d in dtypes if d is not None), key=lambda d: torch.finfo(d).eps, default=None)


class LowestPrecision(TorchDispatchMode):
    """Records the coarsest floating dtype of every op run inside: around the heads' backward, the precision their
    cotangents were computed in (an op computing in float32 and handing float64 on shows as float32)."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                self.dtype = coarsest(self.dtype, leaf.dtype)
        return out


class Reweight(ScheduleRuntime):
    name = "reweight"
    held = "buffer_bytes"

    def __init__(self, advantage_free: bool = True, input_gradients: bool = False):
        # The provisional advantages the heads run at: 0 as well only where the traced loss has advantage-free
        # terms. A loop whose loss has them after all gets cotangents outside the span, which recompute.
        self.advantages = (1.0, 0.0) if advantage_free else (1.0,)
        # A block's engine keeps each row's input gradients too, from cotangents its block call receives
        # (runtime.reweight_blocks); a whole call's provisional backward starts at its own output.
        self.input_gradients = input_gradients

    def for_block(self) -> "Reweight":
        return Reweight(len(self.advantages) > 1, input_gradients=True)

    def block_context(self, found: Found, precision: torch.dtype | None) -> tuple[object, str | None]:
        """The blocks' served calls combine their rows' provisional gradients with the coefficients the backbone
        call's cotangent has at its output (:class:`Coefficients`)."""
        if found.repeated:
            # Which of two equal kept rows a block serves is its own engine's choice: its provisional gradient must
            # be the one these coefficients are found for, so equal kept rows are not told apart.
            return None, "Reweight per block: a row equals several kept rows"
        return Coefficients(found.match, precision), None

    def blocks_kept(self, action: StepAction, sizes: list[int]) -> tuple[range, StepAction]:
        """``reweight@f``: the last blocks, holding the fraction f of the blocks' trainable parameters, keep their
        calls whole for per-sample gradients; the first run natively, and recompute in the update."""
        if action.fraction == 1:
            return range(len(sizes)), action
        return last_blocks(sizes, action.fraction), replace(action, fraction=1.0)

    def keep(self, engine, kept: KeptCall, saved: list[torch.Tensor], action) -> None:
        kept.rows = saved  # until its provisional heads have run
        kept.nbytes = sum(t.numel() * t.element_size() for t in saved)

    def provisional(self, engine, calls: list[KeptCall], heads) -> None:
        """Backpropagate ``heads`` (callables returning the trainer's loss on the kept output) through ``calls``.

        Each head's backbone calls are answered with leaves of the kept values; the heads' cotangents on them form
        each row's basis (the first minus the last, and the last, when several heads share advantage-free terms).
        Calls already backpropagated, and values kept without a program, are passed over."""
        calls = [kept for kept in calls if kept.rowwise is not None and not isinstance(kept.rows, ProvisionalRows)]
        cotangents = {id(kept): [] for kept in calls}
        precision = None  # of the heads' backward, coarsest of all
        for head in heads:
            with engine.answering_with_leaves() as leaves:
                loss = head()
            for kept in calls:
                cotangents[id(kept)].append(torch.zeros_like(kept.output))
            if not leaves or not loss.requires_grad:
                continue
            with LowestPrecision() as seen:
                grads = torch.autograd.grad(loss, [leaf for _, leaf in leaves], allow_unused=True,
                                            materialize_grads=True)
            precision = coarsest(precision, seen.dtype)
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
            grads = [kept.rowwise.backward(kept.key, kept.rows, c.to(kept.output.dtype), per_row=True, factors=True)
                     for c in basis]
            ProvisionalRows.settle(engine, kept, basis, grads, precision=precision)
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

    def gradients(self, engine, match: Match, cotangent: torch.Tensor,
                  inputs: tuple[int, ...] = (), context=None) -> list[torch.Tensor] | None:
        """``context``: a block's call, the backbone call's coefficients (runtime.reweight_blocks.Coefficients)."""
        groups = [(kept.rows, torch.tensor(rows, device=cotangent.device), torch.tensor(positions, device=cotangent.device))
                  for kept, rows, positions in match.by_call()]
        order = torch.cat([positions for _, _, positions in groups])  # this call's rows, grouped by kept call
        if context is not None:  # a block's call: the backbone call's coefficients, found at its output
            if context.values is None:
                return None
            coefficients = context.values[order]
        else:
            basis = torch.cat([rows.cotangents[index] for rows, index, _ in groups])
            coefficients = in_span(basis, cotangent[order], coarsest(*(rows.precision for rows, _, _ in groups)))
            if coefficients is None:
                return None
        # Each parameter's gradient is a matrix-vector product over the rows' provisional gradients, read in place
        # (gathering them first copied every row twice), one per stretch of kept rows (see _stretches) and for all
        # the packed ones at once; one product over the rows' tokens where they are kept as factors
        runs, offset, by_group = [], 0, []
        for provisional, index, _ in groups:
            weights = coefficients[offset:offset + len(index)]
            offset += len(index)
            by_group.append((provisional, index, _InDtypes(weights.t().unsqueeze(2).unsqueeze(3))))
            runs += [(provisional, start, stop, _InDtypes(w.t())) for start, stop, w in _stretches(index, weights)]
        combined: dict[int, torch.Tensor] = {}
        for j, pack in enumerate(_common_packs([provisional for provisional, _, _ in groups])):
            combined.update(pack.unpacked(_over_runs(runs, lambda provisional, j=j: provisional.packs[j].buffers)))
        grads = []
        for i in range(len(groups[0][0].gradients)):
            if i in combined:
                grads.append(combined[i])
                continue
            total = None
            for provisional, index, weights in by_group:
                if i in provisional.factored:
                    product = _combined(provisional.gradients[i], provisional.factored[i], index, weights)
                    total = product if total is None else total.add_(product)
            grads.append(_over_runs(runs, lambda provisional, i=i: provisional.gradients[i], total))
        for i in inputs:  # each row's input gradient: its own combination, placed at its row of the call
            if not all(i in provisional.inputs for provisional, _, _ in groups):
                return None  # the rollout's heads did not reach this input: recompute
            out, offset = None, 0
            for provisional, index, positions in groups:
                weights = coefficients[offset:offset + len(index)]
                offset += len(index)
                per_row = sum(basis_rows.index_select(0, index)
                              * w.to(basis_rows.dtype).view(-1, *[1] * (basis_rows.dim() - 1))
                              for basis_rows, w in zip(provisional.inputs[i], weights.t()) if basis_rows is not None)
                if out is None:
                    out = per_row.new_zeros((len(match.places), *per_row.shape[1:]))
                out.index_copy_(0, positions, per_row)
            grads.append(out)
        return grads


def in_span(basis: torch.Tensor, cotangent: torch.Tensor, precision: torch.dtype | None = None) -> torch.Tensor | None:
    """Per row, the coefficients ``(rows, k)`` of ``cotangent`` ``(rows, *output)`` in the span of the row's
    ``basis`` ``(rows, k, *output)``, or None where a row's residual is more than rounding could leave: that of
    ``precision`` (what the cotangents were computed in) where it is coarser than their dtype."""
    basis, g = basis.double().flatten(2), cotangent.double().flatten(1)
    gram = basis @ basis.transpose(1, 2)
    coefficients = (torch.linalg.pinv(gram) @ (basis @ g.unsqueeze(2))).squeeze(2)
    residual = g - (coefficients.unsqueeze(2) * basis).sum(1)
    tolerance = span_tolerance(coarsest(cotangent.dtype, precision))
    if not bool((residual.norm(dim=1) <= tolerance * g.norm(dim=1)).all()):
        return None
    return coefficients


def _combined(per_basis: tuple[Factors | None, ...], shared: str | None, index: torch.Tensor,
              weights: "_InDtypes") -> torch.Tensor:
    """``sum_k sum_r weights[k, r] left_k[r] @ right_k[r]`` over the kept rows ``index`` (``weights`` ``(k, rows, 1,
    1)``): one product over their tokens. The side the bases share (``shared``: the layer's input, the same tensor
    in each) is read once, the other combined first; each side is read as ``(rows, tokens, size)``, the layout
    the backward made it in."""
    pairs = [(k, f.left.transpose(1, 2), f.right) for k, f in enumerate(per_basis) if f is not None]
    w = weights.of(pairs[0][1].dtype)
    if shared == "right":
        a, b = _weighted_rows([(k, left) for k, left, _ in pairs], w, index), pairs[0][2].index_select(0, index)
    elif shared == "left":
        a, b = pairs[0][1].index_select(0, index), _weighted_rows([(k, right) for k, _, right in pairs], w, index)
    else:  # each basis its own pair: one product over the bases' tokens
        a = torch.cat([left.index_select(0, index) * w[k] for k, left, _ in pairs], 1)
        b = torch.cat([right.index_select(0, index) for _, _, right in pairs], 1)
    rows, tokens, m = a.shape
    return a.reshape(rows * tokens, m).t() @ b.reshape(rows * tokens, b.shape[2])


def _weighted_rows(sides: list[tuple[int, torch.Tensor]], w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_k w[k] * side_k[index]`` over the bases' ``(k, side)``, in place in the first rows gathered."""
    total = None
    for k, side in sides:
        rows = side.index_select(0, index)
        total = rows.mul_(w[k]) if total is None else total.addcmul_(rows, w[k])
    return total


def _over_runs(runs: list[tuple], per_basis, total: torch.Tensor | None = None) -> torch.Tensor | None:
    """``total`` (None: nothing yet) plus the weighted sum of the rows of the dense per-row gradients ``(rows,
    *shape)`` that ``per_basis(provisional)`` gives per cotangent, over the stretches ``runs`` of ``(provisional,
    start, stop, weights)``: one matrix-vector product per stretch and cotangent, read in place. A cotangent whose
    gradient is None (a head that did not reach it) or Factors (combined apart) is passed over."""
    for provisional, start, stop, weights in runs:
        for k, basis_rows in enumerate(per_basis(provisional)):
            if basis_rows is None or isinstance(basis_rows, Factors):
                continue
            rows = basis_rows[start:stop]  # (run, *shape)
            matrix, vector = rows.reshape(stop - start, -1).t(), weights.of(rows.dtype)[k]
            if total is None:
                total = torch.mv(matrix, vector).view(rows.shape[1:])
            else:
                total.view(-1).addmv_(matrix, vector)
    return total


def _common_packs(provisionals: list[ProvisionalRows]) -> tuple[Pack, ...]:
    """The packs of the first kept call where every kept call packed its gradients alike (else none: each
    parameter is combined on its own, through the packs' views)."""
    layouts = {tuple(pack.layout for pack in provisional.packs) for provisional in provisionals}
    return provisionals[0].packs if len(layouts) == 1 else ()


def _shared_side(per_basis: tuple[Factors | None, ...]) -> str | None:
    """Which factor every basis of a parameter holds the same (``"right"``, ``"left"``; None: neither)."""
    present = [f for f in per_basis if f is not None]
    for side in ("right", "left"):
        if all(_same_memory(getattr(f, side), getattr(present[0], side)) for f in present):
            return side
    return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` read the same memory the same way (the same kept tensor, or views of it alike)."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _stretches(index: torch.Tensor, weights: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """The kept rows ``index`` with their ``weights`` ``(rows, k)`` as ``[start, stop)`` stretches of kept rows, each
    with its rows' weights ``(stop - start, k)``: one stretch from the first row to the last, rows not in ``index``
    weighing 0, where it reads at most twice the rows it uses (an update's shuffled micro-batch: one product per
    parameter instead of one per row); else runs of consecutive rows."""
    rows = index.tolist()
    first, last = min(rows), max(rows)
    if last - first + 1 <= 2 * len(rows):
        dense = weights.new_zeros((last - first + 1, weights.shape[1]))
        return [(first, last + 1, dense.index_add_(0, index - first, weights))]
    stretches, offset = [], 0
    for row in rows:
        if stretches and stretches[-1][1] == row:
            stretches[-1][1] = row + 1
        else:
            stretches.append([row, row + 1])
    out = []
    for start, stop in stretches:
        out.append((start, stop, weights[offset:offset + stop - start]))
        offset += stop - start
    return out


class _InDtypes:
    """A stretch's weights ``(k, rows)``, cast once to each dtype the parameters' gradients come in."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    def of(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.weights.to(dtype)
        return self._cast[dtype]


class Coefficients:
    """Per block, at the backbone's output: the coefficients a served backbone call's cotangent has, row by row,
    in the heads' cotangents its kept rows received there. Every block's served backward combines its per-row
    gradients with them: set by the output's backward, which runs before any block's (the blocks feed the
    output). Checked at the output, where the loop's loss hands the cotangent over, not at each block: the
    module's own float32 islands between the output and a block (an RMSNorm's variance) round a cotangent off
    its span there by more than the module's dtype alone would, though the blocks' gradients are the same
    linear function of it. ``values`` None: not in the span, the blocks recompute."""

    def __init__(self, places: Match, precision: torch.dtype | None = None):
        self.places = places  # (kept backbone call, row) per row of the call; each kept call's ``rows`` holds
        # (rows, heads, output size): the heads' cotangents
        self.precision = precision  # the coarsest the heads' cotangents were computed in (None: their dtype)
        self.values: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        return tuple((id(kept), row) for kept, row in self.places.places)

    def at_output(self, output: torch.Tensor, heads) -> torch.Tensor:
        """``output`` through the function that, in its backward, records the cotangent as the current head's
        (while provisional ``heads``, a :class:`~.reweight_blocks.Heads`, run; None: they do not) or finds the
        coefficients."""
        return _AtOutput.apply(self, heads, output)


class _AtOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, coefficients, heads, output):
        ctx.coefficients, ctx.heads = coefficients, heads
        return output.view_as(output)

    @staticmethod
    def backward(ctx, cotangent):
        this, heads, flat = ctx.coefficients, ctx.heads, cotangent.flatten(1)
        groups = [(kept, torch.tensor(rows, device=cotangent.device), torch.tensor(positions, device=cotangent.device))
                  for kept, rows, positions in this.places.by_call()]
        if heads is not None:
            for kept, rows, positions in groups:
                if kept.rows is None:
                    kept.rows = flat.new_zeros((len(kept.inputs[0]), heads.count, flat.shape[1]))
                    heads.recording.add(id(kept))
                if id(kept) in heads.recording:
                    kept.rows[:, heads.current].index_add_(0, rows, flat.index_select(0, positions))
        elif all(isinstance(kept.rows, torch.Tensor) for kept, _, _ in groups):
            order = torch.cat([positions for _, _, positions in groups])
            found = in_span(torch.cat([kept.rows.index_select(0, rows) for kept, rows, _ in groups]), flat[order],
                            this.precision)
            if found is not None:
                this.values = torch.empty_like(found).index_copy_(0, order, found)
        return None, None, cotangent


def last_blocks(sizes: list[int], fraction: float) -> range:
    """The last blocks (their trainable parameters' ``sizes``) holding at most ``fraction`` of them (at least
    one): Reweight keeps those nearest the output, so that the heads' backward stops at the first of them and
    their forward runs the blocks before it without grad."""
    budget, first, held = fraction * sum(sizes), len(sizes) - 1, sizes[-1]
    while first > 0 and held + sizes[first - 1] <= budget:
        first -= 1
        held += sizes[first]
    return range(first, len(sizes))
