"""The kept calls of one module: what both engines (the whole call's, :mod:`.engine`, and the per-block one's,
:mod:`.regional`) keep, index, match, verify and free.

A kept call holds its rows' inputs (indexed by a digest of each row, :func:`~.identity.row_keys`), the tensors every
row shares and its state (:class:`~.identity.CallState`); what else it holds is its engine's and its schedule's
(output values, saved tensors, provisional gradients). A lookup finds, per row of a call, a kept row with the same
digest in the same state, then checks the rows bitwise. Kept calls of other weights' versions can never match
again (counters only grow) and are freed, and the reason is kept for the calls that follow. Each kept call holds the
digest of the weights' values it was made with (:mod:`.digest`), compared with theirs now at every answer: writes
through ``.data`` move no version counter, and weights swapped out and back in (a reference, an EMA) serve again.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .calls import Call, OutputLayout, row_input_names
from .identity import (DIFFERENCES, MODULE_STATE, TRAINING_FLAGS, CallState, StateReader, dtype_differences,
                       first_difference, row_keys)


@dataclass
class KeptCall:
    """One kept call."""

    state: CallState
    inputs: tuple[torch.Tensor, ...]  # what identifies its rows (Call.identity_rows), detached, rows on dimension 0
    whole: tuple[torch.Tensor, ...]  # the tensors every row shares, detached
    # Its output values (several output tensors packed into one, see calls.OutputLayout) and the module's output
    # around them; None where its engine keeps no values (a backbone call whose blocks keep theirs)
    output: torch.Tensor | None = None
    layout: OutputLayout | None = None
    rowwise: object = None  # the RowwiseBackbone that ran it (None: values only, e.g. a KL reference's)
    key: tuple = ()  # its program's key in ``rowwise``
    rows: object = None  # the schedule's per-row record (saved tensors, provisional gradients)
    nbytes: int = 0  # what the schedule holds for it
    weights: torch.Tensor | None = None  # the digest of the weights' values it was made with (None: unreadable)


@dataclass(frozen=True)
class Match:
    """Where each row of a call was found: ``(kept call, row)`` in the call's row order."""

    places: tuple[tuple[KeptCall, int], ...]

    def gather(self) -> torch.Tensor:
        """The kept output values of this call's rows, in its row order (one index per kept call); always a copy,
        so that neither autograd nor the loop's in-place writes touch what is kept."""
        groups = self.by_call()
        if len(groups) == 1 and groups[0][2] == list(range(len(self.places))):
            kept, rows, _ = groups[0]
            return kept.output.index_select(0, torch.tensor(rows, device=kept.output.device))
        out = None
        for kept, rows, positions in groups:
            values = kept.output.index_select(0, torch.tensor(rows, device=kept.output.device))
            if out is None:
                out = values.new_empty((len(self.places), *values.shape[1:]))
            out.index_copy_(0, torch.tensor(positions, device=out.device), values)
        return out

    def output(self, tensor: torch.Tensor):
        """``tensor`` (this call's packed output) as the module's output tree."""
        return self.places[0][0].layout.unpack(tensor)

    def by_call(self):
        """``(kept call, its rows, positions in this call)`` for each kept call involved."""
        groups: dict[int, tuple[KeptCall, list, list]] = {}
        for position, (kept, row) in enumerate(self.places):
            groups.setdefault(id(kept), (kept, [], []))[1].append(row)
            groups[id(kept)][2].append(position)
        return list(groups.values())


@dataclass(frozen=True)
class Found:
    """A lookup's answer: the match, or why there is none (``reason``, and its ``kind`` for the statistics)."""

    match: Match | None
    reason: str = ""
    kind: str = ""
    repeated: bool = False  # some row of the call equals several kept rows in its state


# ``agree(kept, state, call)``: why ``call`` in ``state`` computes differently from ``kept`` whose state differs
# from it in training flags only (None: both modes compute the same, the call may be served)
ModesAgree = Callable[[KeptCall, CallState, Call], "str | None"]


class KeptCalls:
    """The kept calls of one module (``reader`` reads its calls' states)."""

    def __init__(self, reader: StateReader):
        self.reader = reader
        self.calls: list[KeptCall] = []
        self._index: dict[tuple, list[tuple[KeptCall, int]]] = {}
        self.stale: str | None = None  # why the kept calls were last freed, where the weights changed
        self._freed_keys: dict[tuple, str] = {}  # the last freed calls' row digests, and why they were freed
        self.freed: str | None = None  # why every kept call was freed otherwise (auto stopped, the engine failed)
        self.held_bytes = 0
        self.peak_bytes = 0

    def __bool__(self) -> bool:
        return bool(self.calls)

    def __iter__(self):
        return iter(self.calls)

    def add(self, state: CallState, call: Call, keys: list | None = None, weights=None, **held) -> KeptCall:
        """Keep ``call``'s rows (``keys``: their digests, where the caller has them) in ``state``; ``weights``: the
        weights' digest when the call was made, where the caller took it; ``held``: the kept call's other fields."""
        self.drop_stale(state)
        self.stale = self.freed = None
        kept = KeptCall(state, tuple(t.detach() for t in call.identity_rows),
                        tuple(t.detach() for t in call.whole_inputs),
                        weights=self.reader.digest() if weights is None else weights, **held)
        self.calls.append(kept)
        for row, digest in enumerate(keys if keys is not None else row_keys(call.identity_rows)):
            self._index.setdefault(digest, []).append((kept, row))
        return kept

    def count(self, nbytes: int) -> None:
        """``nbytes`` more held by the kept calls (fewer where negative)."""
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    # --------------------------------------------------------------------------------------------- lookup

    def lookup(self, call: Call, keys: list, agree: ModesAgree,
               available: Callable[[KeptCall, int], bool] = lambda kept, row: True,
               taken: Callable[[KeptCall, int], None] | None = None, state: CallState | None = None,
               values: bool = True) -> Found:
        """The kept rows that verifiably recompute ``call``'s rows (their digests ``keys``), or why not. The call's
        ``state`` is read, where not given, only once every row has a candidate. ``available``: whether a kept row
        may still serve (a lookup passes over one that cannot to an equal row of another kept call); ``taken``:
        told of each row found, before the next row is looked up. ``values``: the weights' values are compared too
        (not for a provisional head's call with grad: the leaf it is answered only makes the basis its served calls'
        cotangents are tested against, and each served call compares the values; a head's call without grad, a KL
        reference swapped in through ``.data``, is compared, so that it runs on the weights it reads)."""
        if not self.calls:
            return Found(None, *self.empty())
        candidates = [self._index.get(key, ()) for key in keys]
        if not all(candidates):
            return Found(None, *self._unmatched(call, keys, candidates.index(())))
        state = state if state is not None else self.reader.read(call)
        if self.drop_stale(state):  # made with other weights: never matched again
            return Found(None, *self.empty())
        # read once, where a kept call's state is the call's
        weights = functools.cache(self.reader.digest) if values else None
        places, repeated = [], False
        differences: dict[str, str] = {}  # per kind of difference, the reason of the first kept call that differs so
        verdicts: dict[int, str | None] = {}  # per kept call (its rows share one state): its difference
        for i, kept_rows in enumerate(candidates):
            found, equal = None, 0
            for kept, kept_row in _in_order(kept_rows, places[-1] if places else None,
                                             candidates[i + 1] if i + 1 < len(candidates) else ()):
                if id(kept) not in verdicts:
                    verdicts[id(kept)] = self._difference(kept, state, call, agree, differences, weights)
                if verdicts[id(kept)] is not None:
                    continue
                equal += 1
                if found is None:
                    if available(kept, kept_row):
                        found = (kept, kept_row)
                        if taken is not None:
                            taken(kept, kept_row)
                    else:
                        differences.setdefault("used", "every kept row with these inputs has served its call")
            if found is None:
                # A kept call in the same state had these rows but has served; else the nearest kept call's
                # difference (the one agreeing in the most fields): a KL reference's kept values differ in
                # adapters, the rollout's call in training flags, which is the reason.
                kind = "used" if "used" in differences else max(differences, key=_ORDER.index)
                return Found(None, differences[kind], kind)
            repeated |= equal > 1
            places.append(found)
        match = Match(tuple(places))
        for kept, rows, positions in match.by_call():
            here, there = RowPick(positions), RowPick(rows)
            if not all(torch.equal(here.of(mine), there.of(theirs))
                       for mine, theirs in zip(call.identity_rows, kept.inputs)):
                return Found(None, "inputs equal in digest but not bitwise", "inputs")
            if not all(torch.equal(mine, theirs) for mine, theirs in zip(call.whole_inputs, kept.whole)):
                return Found(None, "a tensor every row shares differs from the kept call's", "inputs")
        return Found(match, repeated=repeated)

    def _difference(self, kept: KeptCall, state: CallState, call: Call, agree: ModesAgree,
                    differences: dict[str, str], weights: Callable | None) -> str | None:
        """The kind in which ``kept``'s state differs from ``state`` where it matters, or its weights' values from
        the weights' now (``weights``; None: not compared), None where it may serve; the reason is recorded in
        ``differences`` under its kind."""
        difference = kept.state.difference(state)
        if difference is None:
            why = None
        elif difference in (TRAINING_FLAGS, MODULE_STATE) and kept.state.program_shows(state):
            why = agree(kept, state, call)
        else:
            why = kept.state.explain(state, self.reader)
        if why is None and weights is not None:  # the same state, or one the programs prove the same: the
            difference, why = WRITTEN, self.reader.written(kept.weights, weights())  # weights' values decide
        if why is None:
            return None
        differences.setdefault(difference, why)
        return difference

    def dtype_variant(self, signature: tuple) -> dict[int, torch.dtype] | None:
        """Where the latest kept call whose signature differs from ``signature`` in tensor arguments' dtypes alone
        is found: those arguments' leaf positions, each with the kept call's dtype (None: no kept call differs so)."""
        for kept in dict.fromkeys(k.state.signature for k in reversed(self.calls)):
            if (differences := dtype_differences(kept, signature)) is not None:
                return differences
        return None

    def empty(self) -> tuple[str, str]:
        """Why nothing matches while nothing is kept (reason, kind)."""
        if self.stale is not None:  # freed because the weights changed: that is the reason
            return f"the kept calls were freed: {self.stale}", "weights"
        if self.freed is not None:
            return f"the kept calls were freed: {self.freed}", "freed"
        return "nothing kept", "nothing kept"

    def _unmatched(self, call: Call, keys: list, row: int) -> tuple[str, str]:
        """Why row ``row`` of ``call`` has no kept row (reason, kind): its rows were kept and freed, an argument's
        dtype or shape differs from every kept call's, or the argument whose values differ from the nearest kept
        row's. Only worked out for a call with grad (a recompute; a rollout's new call is kept, and says nothing)."""
        if keys[row] in self._freed_keys:
            return f"row {row} was kept, and freed: {self._freed_keys[keys[row]]}", "weights"
        # without grad (a rollout's new call, kept), or a block's call (identified by its backbone call's rows)
        if not torch.is_grad_enabled() or call.verified_rows is not None:
            return f"row {row}: no kept call has these inputs", "inputs"
        signature = call.signature()
        alike = [k for k in self.calls if k.state.signature == signature]
        if not alike:
            return (f"row {row}: no kept call has these inputs: argument "
                    f"{first_difference(self.calls[-1].state.signature, signature)}"), "inputs"
        names = row_input_names(call)
        mine = [t[row] for t in call.identity_rows]
        best = min(((k, r) for k in alike for r in range(k.inputs[0].shape[0])),
                   key=lambda kr: sum(not torch.equal(a, b[kr[1]]) for a, b in zip(mine, kr[0].inputs)))
        differing = [n for n, a, b in zip(names, mine, best[0].inputs) if not torch.equal(a, b[best[1]])]
        return (f"row {row}: no kept call has these inputs; the nearest kept row differs in "
                f"{', '.join(differing)}"), "inputs"

    # ------------------------------------------------------------------------------------------- freeing

    def drop_stale(self, state: CallState) -> bool:
        """Free the kept calls made with other weights' versions than ``state``'s; whether any was. Every call is
        kept after this ran, so the kept calls always share one version."""
        if not self.calls or self.calls[0].state.versions == state.versions:
            return False
        stale = [k for k in self.calls if k.state.versions != state.versions]
        self.stale = stale[0].state.explain(state, self.reader)
        # their rows' digests, so that a later call with these rows says why (not "no kept call has these inputs")
        self._freed_keys = {key: self.stale for key, rows in self._index.items()
                            if any(k.state.versions != state.versions for k, _ in rows)}
        self.forget(stale)
        return True

    def forget(self, calls: list[KeptCall]) -> None:
        """Free ``calls`` now: a later call with their inputs runs natively."""
        dropped = {id(k) for k in calls}
        self.calls = [k for k in self.calls if id(k) not in dropped]
        self._index = {key: kept_rows for key, rows in self._index.items()
                       if (kept_rows := [(k, r) for k, r in rows if id(k) not in dropped])}
        self.held_bytes = sum(k.nbytes for k in self.calls)

    def release(self, why: str | None = None) -> None:
        """Free every kept call (``why``: the reason a later call is given, where not that nothing was kept)."""
        self.forget(self.calls)
        self.freed = why

    def take_peak(self) -> int:
        """The most bytes held since the last time."""
        peak, self.peak_bytes = self.peak_bytes, self.held_bytes
        return peak


# A kept call in the call's state whose weights' values differ (written without a version change)
WRITTEN = "written"
# The kinds of difference, nearest last: a kept call in the same state whose weights were written is the nearest
_ORDER = [*(kind for kind, _ in DIFFERENCES), WRITTEN]


def _in_order(kept_rows, previous, following) -> list:
    """Equal rows (a group that sampled one completion twice) give a row several candidates: try first the one
    after the previous row's place, else one whose next row is the next row's candidate, so that a call's rows
    stay consecutive in one kept call (a slice to backpropagate, not a gather; one kept call for bitwise Retain)."""
    if len(kept_rows) < 2:
        return kept_rows
    if previous is not None:
        return sorted(kept_rows, key=lambda c: not (c[0] is previous[0] and c[1] == previous[1] + 1))
    return sorted(kept_rows, key=lambda c: not any(k is c[0] and r == c[1] + 1 for k, r in following))


class RowPick:
    """Rows ``rows`` of tensors with their rows on dimension 0: a slice where they are consecutive (a view, no copy),
    else an index made once per device."""

    def __init__(self, rows: list[int]):
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        self.slice = slice(rows[0], rows[0] + len(rows)) if consecutive else None
        self.rows = rows
        self.index: dict = {}

    def of(self, t: torch.Tensor) -> torch.Tensor:
        if self.slice is not None:
            return t[self.slice]
        if t.device not in self.index:
            self.index[t.device] = torch.tensor(self.rows, device=t.device)
        # index_select copies whole rows; t[index] runs an element-wise gather, about 6x slower on the CPU.
        return t.index_select(0, self.index[t.device])
