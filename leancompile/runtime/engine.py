"""The reuse engine: every backbone call goes through it, and each is served from a kept rollout call only when
it is verified, at the moment it happens, to recompute that call's rows; anything else runs natively.

Keeping. A call the plan keeps (the rollout's trained steps; the caller says so with :meth:`ReuseEngine.keeping`)
runs through :class:`~leancompile.runtime.rowwise.RowwiseBackbone`: its output values, its inputs and state
(:mod:`leancompile.runtime.identity`) and, per row, what its schedule needs later (:mod:`.retain`: the saved
tensors; :mod:`.reweight`: provisional gradients) are kept, indexed by a digest of each row's inputs.

Serving. Any later call looks its rows up by content: each must have a kept row with bitwise-equal inputs and the
same state (weights unmodified, training flags, adapters, autocast), or the whole call recomputes natively and the
step's statistics count the reason. A served call without grad returns the kept values. A served call with grad
returns them through an autograd function whose backward hands the schedule the call's cotangent and returns the
trainable parameters' gradients: they are accumulated into ``.grad`` by that very backward, so a loop that clips,
reads ``.grad`` or steps the optimizer whenever it likes sees exactly the native gradient. Kept calls made with
weights that have since changed can never match again and are freed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from .calls import Call, OutputLayout, output_layout
from .identity import DIFFERENCES, TRAINING_FLAGS, CallState, StateReader, row_keys
from .rowwise import RowwiseBackbone


@dataclass
class KeptCall:
    """One kept backbone call."""

    state: CallState
    inputs: tuple[torch.Tensor, ...]  # what identifies its rows (Call.identity_rows), detached, rows on dimension 0
    whole: tuple[torch.Tensor, ...]  # the tensors every row shares, detached
    output: torch.Tensor  # detached values (several output tensors packed into one, see calls.OutputLayout)
    layout: OutputLayout  # the module's output around ``output``
    rowwise: RowwiseBackbone | None = None  # what ran it (None: values only, e.g. a KL reference)
    key: tuple = ()  # its program's key in ``rowwise``
    rows: object = None  # the schedule's per-row record (saved tensors, provisional gradients)
    nbytes: int = 0  # what the schedule holds for it


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


@dataclass
class CallRecord:
    """What the engine did with one call (the step's ``last_calls``)."""

    action: str  # "served" | "served values" | "recomputed" | "kept" | "not kept"
    rows: int
    reason: str
    kind: str = ""  # the reason's kind, for the statistics
    seconds: float = 0.0  # the program's own time for it (kept: its forward and keep; served: its backward)


@dataclass
class StepLog:
    records: list[CallRecord] = field(default_factory=list)

    def stats(self) -> dict:
        count = lambda action, what: sum(what(r) for r in self.records if r.action == action)
        return {"served_calls": count("served", lambda r: 1),
                "served_rows": count("served", lambda r: r.rows),
                "served_values": count("served values", lambda r: 1),
                "recomputed_calls": count("recomputed", lambda r: 1),
                "recomputed_rows": count("recomputed", lambda r: r.rows),
                "recompute_reasons": dict(Counter(r.kind for r in self.records if r.action == "recomputed"))}


class ScheduleRuntime:
    """What a schedule (Retain, Reweight) adds to the engine: what it keeps per row and how a served call's
    backward turns the call's cotangent into parameter gradients."""

    name = "schedule"
    held = "held_bytes"  # the statistic that reports the peak bytes it keeps

    def keep(self, engine: "ReuseEngine", kept: KeptCall, saved: list[torch.Tensor], action) -> None:
        raise NotImplementedError

    def refusal(self, engine: "ReuseEngine", key: tuple, call: Call) -> str | None:
        """Why this schedule cannot keep calls of compile key ``key`` (None: it can); asked before each keep."""
        return None

    def forward(self, engine: "ReuseEngine", rowwise: RowwiseBackbone, key: tuple, call: Call) -> tuple:
        """Run a call to keep: its output values and what :meth:`keep` is handed (the per-row program's saved
        tensors)."""
        return rowwise.forward(key, call)

    def claim(self, match: Match) -> tuple[str, str] | None:
        """Reserve ``match``'s rows for one served call with grad; why not, and the reason's kind (None: reserved)."""
        return None

    def available(self, kept: KeptCall, row: int) -> bool:
        """Whether ``kept``'s ``row`` can still serve a call with grad (a lookup passes over one that cannot to
        an equal row of another kept call or sample)."""
        return True

    input_gradients = False  # whether a served call's inputs may require grad (their gradients are returned too)

    def for_block(self) -> "ScheduleRuntime | None":
        """A runtime with this one's settings for one transformer block's engine, whose served calls return their
        inputs' gradients too (see runtime.regional); None where this schedule cannot serve a block."""
        return None

    def gradients(self, engine: "ReuseEngine", match: Match, cotangent: torch.Tensor,
                  inputs: tuple[int, ...] = (), context=None) -> list[torch.Tensor] | None:
        """The trainable parameters' gradients for the served rows, then those of the call's tensors at positions
        ``inputs`` (None: not verified, recompute them); ``context``: the engine's when the call was served."""
        raise NotImplementedError


class ReuseEngine:
    """Routes the calls of one module (``backbone``; any arguments, see :mod:`.calls`) through kept calls of
    ``schedule``."""

    def __init__(self, backbone, schedule: ScheduleRuntime, rowwise: dict[float, RowwiseBackbone], sync=None,
                 shared: frozenset[str] = frozenset(), native=None, timed: bool = False):
        self.backbone = backbone
        self.timed = timed  # each kept and served call's own time measured to the device's end (auto compares it)
        # What runs a call natively: the module, or (a block whose forward routes to this engine) its own forward
        self.native = native if native is not None else backbone
        self.shared = shared  # keyword arguments every row shares whatever their size (see runtime.calls)
        self.sync = sync  # the trainer's gradient sync: FSDP2 gathers the current shards before a call
        self.schedule = schedule
        self.rowwise = rowwise  # one per activation budget (Retain's partial retention)
        self.reader = StateReader(backbone, sync.sources() if sync is not None else ())
        self.log = StepLog()
        self.kept: list[KeptCall] = []
        self._index: dict[tuple, list[tuple[KeptCall, int]]] = {}
        self._made: list[KeptCall] = []
        self._keeping = None  # the plan's action for the next call while the caller keeps it
        self._passing = False  # while the caller's calls can neither be kept nor served (see passing)
        # Or, for a wrapped module: the action to keep a call without grad that matches nothing under (None: not
        # kept), asked of each such call (see leancompile.wrap)
        self.admit = None
        # Or, for a block's engine: (call) -> (the tensors identifying its rows, "", "") or (None, why it cannot be
        # matched, the reason's kind) (see runtime.regional)
        self.identity = None
        self._leaves: list | None = None  # while provisional loss heads run: the leaves handed out
        self._answer = None  # and what makes them (None: a leaf of the kept values)
        # Handed to the schedule with a served call's cotangent: set by whoever runs this engine's calls (a block's
        # engine: the backbone call's coefficients under Reweight, see runtime.regional)
        self.context = None
        # While one head runs: the kept rows (id of the call, row) its calls were answered with. Equal samples each
        # get their own kept row, as the update's calls will (see ScheduleRuntime.available).
        self._answered: set = set()
        self._fingerprint = None  # of the weights when the first call was kept; checked at the first lookup
        self._checked = True
        self._same: dict[tuple, bool] = {}  # (kept program key, call's key) -> whether both are the same graphs
        self._stale: str | None = None  # why the kept calls were last freed, where the weights changed
        self.held_bytes = 0
        self.peak_bytes = 0
        self.check_seconds = 0.0  # spent reading states, digesting rows, looking up and verifying this step

    # ------------------------------------------------------------------------------------------ keeping

    @contextlib.contextmanager
    def keeping(self, action):
        """Keep the calls made inside under the plan's ``action`` (a :class:`~leancompile.plan.StepAction`: its
        ``kind`` and ``fraction``). Yields the list of the calls kept."""
        self._keeping, self._made = action, []
        try:
            yield self._made
        finally:
            self._keeping, self._made = None, []

    @contextlib.contextmanager
    def passing(self):
        """Run the calls made inside without grad natively, unchecked: the caller knows nothing of them is kept
        (a rollout step no update trains) and none repeats a kept call, so there is nothing to verify."""
        self._passing = True
        try:
            yield
        finally:
            self._passing = False

    def __call__(self, *args, **kwargs):
        if self.sync is not None:
            self.sync.gather()
        if self._passing and not torch.is_grad_enabled():
            return self.native(*args, **kwargs)
        start = time.perf_counter()
        call = Call.of(args, kwargs, self.shared)
        if call.refusal is not None:
            return self._native(call, f"not reusable: {call.refusal}", "arguments")
        if self.identity is not None:
            rows, reason, kind = self.identity(call)
            if rows is None:
                return self._native(call, reason, kind)
            call = dataclasses.replace(call, identity=rows)
        if self._keeping is not None:
            return self._keep(call, self.reader.read(call), start, self._keeping)
        keys = row_keys(call.identity_rows) if self.kept or self._leaves is not None else None
        match, reason, kind = self._lookup(call, keys)
        self.check_seconds += time.perf_counter() - start
        if match is not None and self._leaves is not None and torch.is_grad_enabled():
            # A provisional head differentiates the kept output: a leaf, or what the caller's ``answer`` makes of it
            answered = self._answer(match, call) if self._answer is not None else match.gather().requires_grad_()
            self._leaves.append((match, answered))
            return match.output(answered)
        if match is not None and not torch.is_grad_enabled():
            self.log.records.append(CallRecord("served values", len(match.places), "kept values"))
            return match.output(match.gather())
        if match is None and self.admit is not None and not torch.is_grad_enabled():
            action = self.admit(call)
            if action is not None:
                return self._keep(call, self.reader.read(call), time.perf_counter(), action)
        if match is not None:
            inputs, reason, kind = self._grad_inputs(match, call)
            if reason is None:
                reason, kind = self.schedule.claim(match) or (None, "")
            if reason is None:
                record = CallRecord("served", len(match.places), f"verified ({self.schedule.name})")
                self.log.records.append(record)
                tensors = call.tensors
                return match.output(_Served.apply(self, match, call, record, inputs, *self.trainable(match),
                                                  *(tensors[i] for i in inputs)))
        output = self._native(call, reason, kind)
        if self._leaves is not None and not torch.is_grad_enabled():
            self._remember_values(call, output, keys)  # e.g. a KL reference the update will ask for again
        return output

    def program_refusal(self, call: Call) -> str | None:
        """Why a call like ``call`` cannot be kept by its one-row program (compiled now if it is not yet)."""
        return self.rowwise[1.0].program(self.reader.read(call).compile_key, call).refusal

    def _clock(self, device: torch.device) -> float:
        """Now, once the device has finished what was queued where the program's time is measured (``timed``)."""
        if self.timed and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _remember_values(self, call: Call, output, keys) -> None:
        """Keep a call's output values only (no activations): a later equal call without grad is served them."""
        start = time.perf_counter()
        tensor, layout, refusal = output_layout(output)
        if refusal is None:
            state = self.reader.read(call)
            self._drop_stale(state)
            if self._fingerprint is None:  # an engine that keeps values only (a KL reference's) checks them too
                self._fingerprint, self._checked = self.reader.fingerprint(), False
            self._remember(state, call, tensor.detach(), layout, keys=keys)
        self.check_seconds += time.perf_counter() - start

    def _native(self, call: Call, reason: str, kind: str):
        """The module's own call; one with grad is counted as recomputed, with ``reason``."""
        if torch.is_grad_enabled():
            self.log.records.append(CallRecord("recomputed", call.batch, reason, kind))
        return self.native(*call.args, **call.kwargs)

    def _grad_inputs(self, match: Match, call: Call) -> tuple[tuple[int, ...], str | None, str]:
        """The positions among the call's tensors that require grad (a block's hidden states, between blocks), or
        why a served call cannot return their gradients."""
        inputs = tuple(i for i, t in enumerate(call.tensors) if t.requires_grad)
        if not inputs:
            return inputs, None, ""
        if not self.schedule.input_gradients:
            return inputs, "an input requires grad: its gradient is not kept", "input grad"
        kept = match.places[0][0]
        if not set(inputs) <= set(kept.rowwise.program_of(kept.key).input_grads):
            return inputs, "an input every row shares requires grad: its gradient is not kept", "input grad"
        return inputs, None, ""

    def _keep(self, call: Call, state: CallState, start: float, action):
        """Run the call through the per-row backbone and keep it under the plan's ``action`` (``start``: when its
        checks began)."""
        self._drop_stale(state)
        self.check_seconds += time.perf_counter() - start
        rowwise = self.rowwise[getattr(action, "fraction", 1.0)]
        key = state.compile_key
        program = rowwise.program(key, call)
        refusal = program.refusal or self.schedule.refusal(self, key, call)
        if refusal is not None:
            self.log.records.append(CallRecord("not kept", call.batch, refusal, "not keepable"))
            return self.native(*call.args, **call.kwargs)
        start = time.perf_counter()
        if self._fingerprint is None:
            self._fingerprint = self.reader.fingerprint()
        self.check_seconds += time.perf_counter() - start
        began = self._clock(call.device)
        output, saved = self.schedule.forward(self, rowwise, key, call)
        seconds = self._clock(call.device) - began
        start = time.perf_counter()
        kept = self._remember(state, call, output, program.output, rowwise, key)
        self.check_seconds += time.perf_counter() - start
        began = self._clock(call.device)
        self.schedule.keep(self, kept, saved, action)
        seconds += self._clock(call.device) - began
        self._count(kept.nbytes)
        self._checked = False
        if self._keeping is not None:  # the caller's list of what it kept (a wrapped module's admission has none)
            self._made.append(kept)
        self.log.records.append(CallRecord("kept", call.batch, str(getattr(action, "kind", action)), "", seconds))
        return program.output.unpack(output, copy=True)  # the loop may write into what it gets; the kept stays

    def _remember(self, state, call: Call, output, layout, rowwise=None, key=(), keys=None) -> KeptCall:
        self._stale = None
        kept = KeptCall(state, tuple(t.detach() for t in call.identity_rows),
                        tuple(t.detach() for t in call.whole_inputs), output, layout, rowwise, key)
        self.kept.append(kept)
        for row, digest in enumerate(keys if keys is not None else row_keys(call.identity_rows)):
            self._index.setdefault(digest, []).append((kept, row))
        return kept

    # ------------------------------------------------------------------------------------------ serving

    def _lookup(self, call: Call, keys) -> tuple[Match | None, str, str]:
        """The kept rows that verifiably recompute this call's rows (row digests ``keys``), or why not (reason,
        kind). The call's state is read only once every row has a candidate."""
        if not self.kept:
            if self._stale is not None:  # freed because the weights changed: that is the reason
                return None, f"the kept calls were freed: {self._stale}", "weights"
            return None, "nothing kept", "nothing kept"
        candidates = [self._index.get(key, ()) for key in keys]
        if not all(candidates):
            return None, f"row {candidates.index(())}: no kept call has these inputs", "inputs"
        state = self.reader.read(call)
        places, differences = [], {}  # the reasons' kinds, each with a kept call that differs so
        verdicts: dict[int, str | None] = {}  # per kept call: its rows share one state
        for i, kept_rows in enumerate(candidates):
            found = None
            for kept, kept_row in _in_order(kept_rows, places[-1] if places else None,
                                             candidates[i + 1] if i + 1 < len(candidates) else ()):
                if id(kept) not in verdicts:
                    difference = kept.state.difference(state)
                    if difference == TRAINING_FLAGS and self._same_program(kept, state, call):
                        difference = None
                    verdicts[id(kept)] = difference
                difference = verdicts[id(kept)]
                if difference is not None:
                    differences.setdefault(difference, kept)
                elif not self.schedule.available(kept, kept_row) or (id(kept), kept_row) in self._answered:
                    differences.setdefault("used", kept)  # an equal row was there but has served its call
                else:
                    found = (kept, kept_row)
                    break
            if found is None:
                break
            places.append(found)
            if self._leaves is not None:
                self._answered.add((id(found[0]), found[1]))
        self._drop_stale(state)
        if len(places) < len(keys):
            if "used" in differences:  # a kept call in the same state had these rows
                return None, "every kept row with these inputs has served its call", "used"
            # The nearest kept call's difference (the one agreeing in the most fields): a KL reference's kept values
            # differ in adapters, the rollout's call after an optimizer step in weights, which is the reason.
            kind = max(differences, key=[kind for kind, _ in DIFFERENCES].index)
            return None, differences[kind].state.explain(state, self.reader), kind
        match = Match(tuple(places))
        for kept, rows, positions in match.by_call():
            here, there = RowPick(positions), RowPick(rows)
            if not all(torch.equal(here.of(mine), there.of(theirs))
                       for mine, theirs in zip(call.identity_rows, kept.inputs)):
                return None, "inputs equal in digest but not bitwise", "inputs"
            if not all(torch.equal(mine, theirs) for mine, theirs in zip(call.whole_inputs, kept.whole)):
                return None, "a tensor every row shares differs from the kept call's", "inputs"
        # Once per update phase (the first match served after calls were kept, the rollout's own heads aside):
        # writes through .data move no version counter.
        if not self._checked and self._leaves is None:
            self._checked = True
            if not torch.equal(self.reader.fingerprint(), self._fingerprint):
                self.release()
                return None, "a weight was written in place (through .data) since it was kept", "weights"
        return match, "", ""

    def _same_program(self, kept: KeptCall, state: CallState, call: Call) -> bool:
        """Whether ``call``, under its own training flags, runs the very graphs the kept call ran: then the flags
        that differ (a rollout in ``eval()``, an update in ``train()``) read nothing that changes the result."""
        if kept.rowwise is None:
            return False
        pair = (kept.key, state.compile_key)
        if pair not in self._same:
            start = time.perf_counter()
            theirs, mine = kept.rowwise.program_of(kept.key), kept.rowwise.program(state.compile_key, call)
            self._same[pair] = mine.refusal is None and mine.digest == theirs.digest
            self.check_seconds -= time.perf_counter() - start  # compiling, once: not a check's cost
        return self._same[pair]

    def _drop_stale(self, state: CallState) -> None:
        """Kept calls made with other weights versions never match again (counters only grow): free them. Every
        call is kept after this ran, so the kept calls always share one version."""
        if not self.kept or self.kept[0].state.versions == state.versions:
            return
        stale = [k for k in self.kept if k.state.versions != state.versions]
        self._stale = stale[0].state.explain(state, self.reader)
        self.forget(stale)
        if not self.kept:  # the fingerprint was of the weights they were made with
            self._fingerprint, self._checked = None, True

    def forget(self, calls: list[KeptCall]) -> None:
        """Free ``calls`` now: a later call with their inputs runs natively."""
        dropped = {id(k) for k in calls}
        self.kept = [k for k in self.kept if id(k) not in dropped]
        self._reindex(calls)

    def _reindex(self, dropped) -> None:
        dropped = {id(k) for k in dropped}
        self._index = {key: kept_rows for key, rows in self._index.items()
                       if (kept_rows := [(k, r) for k, r in rows if id(k) not in dropped])}
        self.held_bytes = sum(k.nbytes for k in self.kept)

    @staticmethod
    def trainable(match: Match) -> list[torch.Tensor]:
        """The parameters a served call's backward gives gradients to (equal state: equal for every kept call)."""
        kept = match.places[0][0]
        return kept.rowwise.trainable(kept.key)

    def _count(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    # ---------------------------------------------------------------------------------------- provisional

    @property
    def answering_with_leaves_now(self) -> bool:
        """Whether provisional loss heads are running (their calls with grad are answered with leaves)."""
        return self._leaves is not None

    @contextlib.contextmanager
    def answering_with_leaves(self, answer=None):
        """Inside, a call with grad that matches kept rows returns them as a leaf (a loss head on the kept output,
        no second forward), or as ``answer(match, call)`` makes them (a block's kept output inside the module's
        autograd graph, see runtime.regional); calls without grad that do not match are kept as values. Yields the
        list of ``(match, what was returned)``."""
        self._leaves, self._answered, self._answer = [], set(), answer
        try:
            yield self._leaves
        finally:
            self._leaves, self._answered, self._answer = None, set(), None

    def provisional(self, heads: list, calls: list[KeptCall] | None = None) -> None:
        """Reweight: backpropagate the loss ``heads`` (callables returning the loss on this module's calls)
        through the kept ``calls`` (default: every kept call) that have not been yet."""
        with torch.enable_grad():
            self.schedule.provisional(self, list(self.kept if calls is None else calls), heads)

    # ----------------------------------------------------------------------------------------- lifetime

    def release(self) -> None:
        self.kept, self._index = [], {}
        self.held_bytes = 0
        self._fingerprint, self._checked = None, True

    def take_stats(self) -> dict:
        """What happened since the last time: calls served and recomputed and why, peak bytes held, check time."""
        stats = {**self.log.stats(), self.schedule.held: self.peak_bytes, "check_seconds": self.check_seconds}
        self.log, self.peak_bytes, self.check_seconds = StepLog(), self.held_bytes, 0.0
        return stats

    def end_step(self) -> dict:
        stats = self.take_stats()
        self.release()
        self.peak_bytes = 0
        return stats


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


class _Served(torch.autograd.Function):
    """A served call: its output is the kept values; its backward asks the schedule for the parameters' gradients
    (or, where the schedule cannot verify them, recomputes the rows natively)."""

    @staticmethod
    def forward(ctx, engine, match, call, record, inputs, *tensors):
        """``tensors``: the trainable parameters, then the call's tensors at positions ``inputs``."""
        ctx.engine, ctx.match, ctx.call, ctx.record, ctx.inputs = engine, match, call, record, inputs
        ctx.context = engine.context
        return match.gather()

    @staticmethod
    def backward(ctx, cotangent):
        engine, match = ctx.engine, ctx.match
        began = engine._clock(cotangent.device)
        grads = engine.schedule.gradients(engine, match, cotangent, ctx.inputs, ctx.context)
        ctx.record.seconds = engine._clock(cotangent.device) - began
        if grads is None:
            ctx.record.action, ctx.record.kind = "recomputed", "cotangent"
            ctx.record.reason = "its cotangent is not in the span of those the rollout backpropagated"
            grads = _native_gradients(engine, ctx.call, match, cotangent, ctx.inputs)
        return (None, None, None, None, None, *grads)


def _native_gradients(engine, call: Call, match: Match, cotangent, inputs: tuple[int, ...]) -> list[torch.Tensor]:
    """The call's forward and backward as the loop would have run them (same autocast state)."""
    enabled, dtype = match.places[0][0].state.autocast
    tensors = call.tensors
    with torch.enable_grad(), torch.autocast(call.device.type, dtype=dtype, enabled=enabled):
        output, _, _ = output_layout(engine.native(*call.args, **call.kwargs))
    return list(torch.autograd.grad(output, [*engine.trainable(match), *(tensors[i] for i in inputs)], cotangent,
                                    allow_unused=True, materialize_grads=True))
