"""The reuse engine: every backbone call goes through it, and each is served from a kept rollout call only when
it is verified, at the moment it happens, to recompute that call's rows; anything else runs natively.

Keeping. A call its policy keeps (:mod:`.policy`: the plan's trained steps, or a wrapped loop's rollout) runs
through :class:`~leancompile.runtime.rowwise.RowwiseBackbone`: its output values, its inputs and state
(:mod:`leancompile.runtime.identity`) and, per row, what its schedule needs later (:mod:`.retain`: the saved
tensors; :mod:`.reweight`: provisional gradients) are kept in its store (:mod:`.store`), indexed by a digest of each
row's inputs.

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

from ..plan import VALUES
from .calls import Call, output_layout
from .dtypes import through_casts
from .identity import TRAINING_FLAGS, StateReader, row_keys
from .policy import KeepPolicy, StepPolicy
from .rowwise import RowwiseBackbone
from .schedule_runtime import ScheduleRuntime
from .store import Found, KeptCall, KeptCalls, Match


@dataclass
class CallRecord:
    """What the engine did with one call (the step's ``last_calls``)."""

    action: str  # "served" | "served values" | "recomputed" | "kept" | "not kept"
    rows: int
    reason: str
    kind: str = ""  # the reason's kind, for the statistics
    seconds: float = 0.0  # the program's own time for it (kept: its forward and keep; served: its backward)


# The peak bytes the kept calls held, by what: activations (Retain), per-row gradients (Reweight)
HELD = ("retained_bytes", "buffer_bytes")


def no_stats() -> dict:
    """The statistics of a step in which nothing went through an engine: every key of the schema, at zero (a module
    run natively, auto's fallback, a refused framework), so that a loop reads the same keys whatever happened.
    ``stopped``: why nothing is kept any more, where that was decided (auto measured native faster, or the update
    served none of its rollouts' calls)."""
    return {**StepLog().stats(), **dict.fromkeys(HELD, 0), "check_seconds": 0.0, "compile_seconds": 0.0,
            "stopped": None}


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


@dataclass(frozen=True)
class Verified:
    """What identifies a call's rows where its caller verified them (a block's call inside a verified backbone
    call, see runtime.regional: the backbone call's rows), or why it cannot be served (``rows`` None: the reason
    and its kind); ``context``: what the schedule is handed with a served call's cotangent."""

    rows: tuple[torch.Tensor, ...] | None
    reason: str = ""
    kind: str = ""
    context: object = None


class ReuseEngine:
    """Routes the calls of one module (``backbone``; any arguments, see :mod:`.calls`) through kept calls of
    ``schedule_runtime`` (its schedule's hooks); ``policy`` says which calls to keep."""

    def __init__(self, backbone, schedule_runtime: ScheduleRuntime, rowwise: dict[float, RowwiseBackbone],
                 policy: KeepPolicy | None = None, sync=None, shared: frozenset[str] = frozenset(), native=None,
                 timed: bool = False, verified=None, log: StepLog | None = None, verify: str = VALUES):
        """``verified(call) -> Verified``: where a caller verifies this engine's calls (a block's engine, see
        runtime.regional), what identifies their rows; None: their own row inputs. ``log``: where the calls are
        recorded, where engines share one (default: its own). ``verify``: what an answer is checked against besides
        the state (plan.VERIFY)."""
        self.backbone = backbone
        self.policy = policy if policy is not None else StepPolicy()
        self.timed = timed  # each kept and served call's own time measured to the device's end (the calibration)
        # What runs a call natively: the module, or (a block whose forward routes to this engine) its own forward
        self.native = native if native is not None else backbone
        self.shared = shared  # keyword arguments every row shares whatever their size (see runtime.calls)
        self.sync = sync  # the trainer's gradient sync: FSDP2 gathers the current shards before a call
        self.schedule_runtime = schedule_runtime
        self.rowwise = rowwise  # one per activation budget (Retain's partial retention)
        self.verified = verified
        self.verify = verify
        self.reader = StateReader(backbone, sync.sources() if sync is not None else (), verify=verify)
        self.store = KeptCalls(self.reader)
        self.log = log if log is not None else StepLog()
        self._leaves: list | None = None  # while provisional loss heads run: the leaves handed out
        self._answer = None  # and what makes them (None: a leaf of the kept values)
        # While one head runs: the kept rows (id of the call, row) its calls were answered with. Equal samples each
        # get their own kept row, as the update's calls will (see ScheduleRuntime.available).
        self._answered: set = set()
        self._same: dict[tuple, bool] = {}  # (kept program key, call's key) -> whether both are the same graphs
        self.check_seconds = 0.0  # spent reading states, digesting rows, looking up and verifying this step
        self._compile_taken = 0.0  # compiled_seconds when the statistics were last taken
        # Told (with the error) where a served call's backward raises, which then recomputes natively; None: it raises
        self.failed = None

    @property
    def kept(self) -> list[KeptCall]:
        return self.store.calls

    @property
    def held_bytes(self) -> int:
        return self.store.held_bytes

    def __call__(self, *args, **kwargs):
        if self.sync is not None:
            self.sync.gather()
        directive = self.policy.directive()
        if directive.unchecked and not torch.is_grad_enabled():
            return self.native(*args, **kwargs)
        start = time.perf_counter()
        call = Call.of(args, kwargs, self.shared)
        if call.refusal is not None:
            return self._native(call, f"not reusable: {call.refusal}", "arguments")
        context = None
        if self.verified is not None:
            verified = self.verified(call)
            if verified.rows is None:
                return self._native(call, verified.reason, verified.kind)
            call, context = dataclasses.replace(call, verified_rows=verified.rows), verified.context
        if directive.keep is not None:
            return self._keep(call, self.reader.read(call), start, directive.keep, directive.made)
        if torch.is_grad_enabled() and self._leaves is None:
            self.policy.closed(self)
        keys = row_keys(call.identity_rows) if self.store or self._leaves is not None else None
        found = self._looked_up(call, keys)
        match = found.match
        self.check_seconds += time.perf_counter() - start
        if match is not None and self._leaves is not None and torch.is_grad_enabled():
            # A provisional head differentiates the kept output: a leaf, or what the caller's ``answer`` makes of it
            answered = self._answer(match, call) if self._answer is not None else match.gather().requires_grad_()
            self._leaves.append((match, answered))
            return match.output(answered)
        if match is not None and not torch.is_grad_enabled():
            self.log.records.append(CallRecord("served values", len(match.places), "kept values"))
            return match.output(match.gather())
        if match is None and not torch.is_grad_enabled():
            action = self.policy.unmatched(call, self)
            if action is not None:
                return self._keep(call, self.reader.read(call), time.perf_counter(), action)
        reason, kind = found.reason, found.kind
        if match is not None:
            inputs, reason, kind = self._grad_inputs(match, call)
            if reason is None:
                reason, kind = self.schedule_runtime.claim(match) or (None, "")
            if reason is None:
                record = CallRecord("served", len(match.places), f"verified ({self.schedule_runtime.name})")
                self.log.records.append(record)
                tensors = call.tensors
                return match.output(_Served.apply(self, match, call, record, inputs, context,
                                                  *self.trainable(match), *(tensors[i] for i in inputs)))
        output = self._native(call, reason, kind)
        if self._leaves is not None and not torch.is_grad_enabled():
            self._remember_values(call, output, keys)  # e.g. a KL reference the update will ask for again
        return output

    def program_refusal(self, call: Call) -> str | None:
        """Why a call like ``call`` cannot be kept by its one-row program (compiled now if it is not yet)."""
        return self.rowwise[1.0].program(self.reader.read(call).compile_key, call).refusal

    @property
    def compiled_seconds(self) -> float:
        """Seconds its programs spent compiling and tracing, in all."""
        return sum(rowwise.compile_seconds for rowwise in self.rowwise.values())

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
            self.store.add(self.reader.read(call), call, keys, output=tensor.detach(), layout=layout)
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
        if not self.schedule_runtime.input_gradients:
            return inputs, "an input requires grad: its gradient is not kept", "input grad"
        kept = match.places[0][0]
        if not set(inputs) <= set(kept.rowwise.program_of(kept.key).input_grads):
            return inputs, "an input every row shares requires grad: its gradient is not kept", "input grad"
        return inputs, None, ""

    def _keep(self, call: Call, state, start: float, action, made: list | None = None):
        """Run the call through the per-row backbone and keep it under the plan's ``action`` (``start``: when its
        checks began; ``made``: the caller's list of what it kept)."""
        self.store.drop_stale(state)
        self.check_seconds += time.perf_counter() - start
        rowwise = self.rowwise[action.fraction]
        key = state.compile_key
        program = rowwise.program(key, call)
        refusal = program.refusal or self.schedule_runtime.refusal(self, key, call)
        if refusal is not None:
            kind = "compile failed" if program.failed else "not keepable"
            self.log.records.append(CallRecord("not kept", call.batch, refusal, kind))
            return self.native(*call.args, **call.kwargs)
        start = time.perf_counter()
        weights = self.reader.digest()  # before the forward, which then finds the weights in cache
        self.check_seconds += time.perf_counter() - start
        began, compiled = self._clock(call.device), self.compiled_seconds
        output, saved = self.schedule_runtime.forward(self, rowwise, key, call)
        seconds = self._clock(call.device) - began - (self.compiled_seconds - compiled)  # the program's run alone
        start = time.perf_counter()
        kept = self.store.add(state, call, weights=weights, output=output, layout=program.output, rowwise=rowwise,
                              key=key)
        self.check_seconds += time.perf_counter() - start
        began = self._clock(call.device)
        self.schedule_runtime.keep(self, kept, saved, action)
        seconds += self._clock(call.device) - began
        self.store.count(kept.nbytes)
        if made is not None:
            made.append(kept)
        self.log.records.append(CallRecord("kept", call.batch, str(action.kind), "", seconds))
        return program.output.unpack(output, copy=True)  # the loop may write into what it gets; the kept stays

    # ------------------------------------------------------------------------------------------ serving

    def _lookup(self, call: Call, keys) -> Found:
        """The kept rows that verifiably recompute this call's rows (the weights' values included), or why not."""
        heads = self._leaves is not None
        return self.store.lookup(call, keys, self._modes_agree, self._available,
                                 (lambda kept, row: self._answered.add((id(kept), row))) if heads else None,
                                 values=not (heads and torch.is_grad_enabled()))

    def _looked_up(self, call: Call, keys) -> Found:
        """The call's lookup; where no kept row has its rows and a kept call differs from it in some arguments'
        dtypes alone, the call with them cast to the kept dtypes, where the module reads them only so (.dtypes)."""
        found = self._lookup(call, keys)
        if found.match is not None or found.kind != "inputs":
            return found
        cast = through_casts(call, self.store, self._graphs, lambda c: self._lookup(c, row_keys(c.identity_rows)),
                             self.shared)
        return found if cast is None else cast[0]

    def _graphs(self, call: Call) -> tuple:
        """The forward and backward of ``call``'s one-row program (compiled now if it is not yet: not a check's
        cost)."""
        start = time.perf_counter()
        program = self.rowwise[1.0].program(self.reader.read(call).compile_key, call)
        self.check_seconds -= time.perf_counter() - start
        if program.forward is None:
            raise RuntimeError(program.refusal)
        return program.forward, program.backward

    def _available(self, kept: KeptCall, row: int) -> bool:
        return self.schedule_runtime.available(kept, row) and (id(kept), row) not in self._answered

    def _modes_agree(self, kept: KeptCall, state, call: Call) -> str | None:
        """Why ``call``, under its own training flags, attributes and hooks, may not run the graphs the kept call
        ran (None: it runs the very same ones, so what differs, a rollout in ``eval()`` and an update in ``train()``,
        a hook that makes the embeddings' output require grad, changes nothing the call computes). Each program was
        traced through the module as it was when compiled, hooks included; a copy traced in its place (a block's,
        see runtime.regional) holds the hooks and attributes it was made with, so only training flags are proven
        on it."""
        live = kept.rowwise is not None and kept.rowwise.traced is kept.rowwise.backbone
        if kept.rowwise is not None and (live or kept.state.difference(state) == TRAINING_FLAGS):
            pair = (kept.key, state.compile_key)
            if pair not in self._same:
                start = time.perf_counter()
                theirs, mine = kept.rowwise.program_of(kept.key), kept.rowwise.program(state.compile_key, call)
                self._same[pair] = mine.refusal is None and mine.digest == theirs.digest
                self.check_seconds -= time.perf_counter() - start  # compiling, once: not a check's cost
            if self._same[pair]:
                return None
        return kept.state.explain(state, self.reader)

    def forget(self, calls: list[KeptCall]) -> None:
        """Free ``calls`` now: a later call with their inputs runs natively."""
        self.store.forget(calls)

    @staticmethod
    def trainable(match: Match) -> list[torch.Tensor]:
        """The parameters a served call's backward gives gradients to (equal state: equal for every kept call)."""
        kept = match.places[0][0]
        return kept.rowwise.trainable(kept.key)

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

    def provisional(self, heads: list) -> None:
        """Backpropagate the loss ``heads`` (callables returning the loss on this module's calls) through the kept
        calls that have not been yet (the schedule's, see ScheduleRuntime.advantages)."""
        with torch.enable_grad():
            self.schedule_runtime.provisional(self, list(self.store), heads)

    # ----------------------------------------------------------------------------------------- lifetime

    def release(self, why: str | None = None) -> None:
        """Free every kept call now (``why``: what a later call that finds none is told)."""
        self.store.release(why)

    def take_stats(self) -> dict:
        """What happened since the last time: calls served and recomputed and why, peak bytes held, check time."""
        stats = {**no_stats(), **self.log.stats(), self.schedule_runtime.held: self.store.take_peak(),
                 "check_seconds": self.check_seconds,
                 "compile_seconds": self.compiled_seconds - self._compile_taken}
        self._compile_taken = self.compiled_seconds
        self.log.records.clear()
        self.check_seconds = 0.0
        return stats

    def end_step(self) -> dict:
        stats = self.take_stats()
        self.release()
        self.store.take_peak()
        return stats


class _Served(torch.autograd.Function):
    """A served call: its output is the kept values; its backward asks the schedule for the parameters' gradients
    (or, where the schedule cannot verify them, recomputes the rows natively)."""

    @staticmethod
    def forward(ctx, engine, match, call, record, inputs, context, *tensors):
        """``tensors``: the trainable parameters, then the call's tensors at positions ``inputs``."""
        ctx.engine, ctx.match, ctx.call, ctx.record, ctx.inputs = engine, match, call, record, inputs
        ctx.context = context
        return match.gather()

    @staticmethod
    def backward(ctx, cotangent):
        engine, match = ctx.engine, ctx.match
        began, compiled = engine._clock(cotangent.device), engine.compiled_seconds
        reason, kind = "its cotangent is not in the span of those the rollout backpropagated", "cotangent"
        try:
            grads = engine.schedule_runtime.gradients(engine, match, cotangent, ctx.inputs, ctx.context)
        except Exception as error:
            if engine.failed is None:
                raise
            engine.failed(error)
            grads, reason, kind = None, f"its backward failed ({type(error).__name__}: {error})", "unsupported"
        ctx.record.seconds = engine._clock(cotangent.device) - began - (engine.compiled_seconds - compiled)
        if grads is None:
            ctx.record.action, ctx.record.kind, ctx.record.reason = "recomputed", kind, reason
            grads = _native_gradients(engine, ctx.call, match, cotangent, ctx.inputs)
        return (None, None, None, None, None, None, *grads)


def _native_gradients(engine, call: Call, match: Match, cotangent, inputs: tuple[int, ...]) -> list[torch.Tensor]:
    """The call's forward and backward as the loop would have run them (same autocast state)."""
    enabled, dtype = match.places[0][0].state.autocast
    tensors = call.tensors
    with torch.enable_grad(), torch.autocast(call.device.type, dtype=dtype, enabled=enabled):
        output, _, _ = output_layout(engine.native(*call.args, **call.kwargs))
    return list(torch.autograd.grad(output, [*engine.trainable(match), *(tensors[i] for i in inputs)], cotangent,
                                    allow_unused=True, materialize_grads=True))
