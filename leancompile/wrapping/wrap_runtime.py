"""The runtime behind a wrapped module (:func:`leancompile.wrap`): the engine and its policy built from the
wrapper's request, the checks that no framework took the module's parameters over, the descent to a submodule
where the module's own program cannot keep its calls or where a wrapper (DDP) must run its own forward around
them, auto's measurement against native, and the look back at each optimizer step (:mod:`.watch`)."""
from __future__ import annotations

import functools
import statistics
import warnings
from collections import Counter

import torch
from torch.utils import _pytree as pytree

from ..backbones.families import family_of
from ..backbones.plain import fsdp1_routed, fsdp1_unit, fully_sharded, named_weights
from ..passes.pipeline import PassHistory
from ..plan import AUTO, Action, Schedule, StepAction
from ..request import Request
from ..runtime.auto import forward_seconds, program_seconds_per_row, slower, update_seconds
from ..runtime.bitwise import BitwiseRetain
from ..runtime.calls import Call, bound, named_forward
from ..runtime.engine import CallRecord, ReuseEngine
from ..runtime.frameworks import framework_refusal, passed_through
from ..runtime.policy import RolloutPolicy
from ..runtime.regional import RegionalEngine, transformer_blocks
from ..runtime.rowwise import RowwiseBackbone
from ..schedules import SCHEDULES
from .watch import FIXES, REGISTRATIONS, NothingServedError, NothingServedWarning, watch
from .wrapped import RUNTIME, untraced, wrapped_class


# auto: native is timed on this many kept calls and served calls each (beside the program: like with like), and
# this many steps that served calls are weighed (the second counts a compile that recurs)
NATIVE_SAMPLES = 3
WEIGHED_STEPS = 2

# Rollouts in a row whose kept calls served none of the update's, after which nothing more is kept
BARREN_ROLLOUTS = 2

# Calls made while an engine runs (its native calls, its traces) run the module itself, a wrapped submodule too.
_INSIDE = [0]


class WrapRuntime:
    """What a wrapped module's calls go through: the engine, what it keeps (its policy), the checks that a
    framework around the module has not taken its parameters over, the submodule that serves the calls the module's
    own program cannot keep, and the watch for a loop that gains nothing."""

    def __init__(self, module: torch.nn.Module, request: Request):
        self.request = request
        self.notes: list[CallRecord] = []  # what the wrapper itself decided (a refusal, a descent)
        self.below: tuple[str, torch.nn.Module] | None = None  # (name, submodule) serving the calls refused here
        self.refused: dict[tuple, bool] = {}  # per call signature: whether the submodule serves such calls
        self.window: list[CallRecord] = []  # the calls since the last optimizer step over the module's weights
        self.served_ever = False
        self.barren = 0  # rollouts in a row whose kept calls the update served none of (see _stop_keeping)
        self.warned: set[str] = set()
        self.watched = True  # by the optimizer-step watch (a submodule serving after a descent: by its parent's)
        self.refusal = framework_refusal(module, request.schedule, request.per_block)
        self._build(module)
        # DDP: its own forward runs around every call and the module it holds serves them (passed_through)
        self.through = passed_through(module)
        if self.through is not None:
            self._descend(self.through)

    def _read_parameters(self, module: torch.nn.Module) -> None:
        """The module's parameters as they are now: which the engine reads, which the optimizer-step watch follows,
        and whether a submodule could serve calls this module's program cannot keep."""
        self.registrations, self.structure = REGISTRATIONS[0], structure(module)
        self.trainable = [p for _, p in named_weights(module) if p.requires_grad]
        self.descendable = _largest_trainable_child(module) is not None

    def _build(self, module: torch.nn.Module) -> None:
        self._read_parameters(module)
        self.engine, self.policy = build_engine(module, self.request)
        for engine in getattr(self.engine, "engines", (self.engine,)):  # a served backward that raises
            engine.failed = functools.partial(self.failed, stacklevel=2)
        # auto (the whole-call engine only): native's seconds per row, timed right after the program ran the same
        # call (a kept call's forward without grad; a served call's forward with grad and its backward), on the
        # first NATIVE_SAMPLES of each; weighed once calls were served, then None
        auto = self.request.schedule == AUTO and isinstance(self.engine, ReuseEngine)
        self.native: dict[str, list[float]] | None = {"kept": [], "served": []} if auto else None
        self.checks = 0.0  # the engine's check seconds in the calls since the last optimizer step
        self.weighed = 0  # steps weighed so far (of WEIGHED_STEPS)
        self.compiled = 0.0  # the engine's compile seconds at the last optimizer step

    def chain(self):
        """This runtime and those of the submodules serving the calls refused here, top down."""
        yield self
        if self.below is not None:
            yield from self.below[1].__dict__[RUNTIME].chain()

    @property
    def serving(self) -> "WrapRuntime":
        """The runtime whose engine serves: this one's, or the submodule's once this one's calls were refused."""
        return self.below[1].__dict__[RUNTIME].serving if self.below is not None else self

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        if _INSIDE[0]:
            return torch.nn.Module.__call__(module, *args, **kwargs)
        _INSIDE[0] += 1
        try:
            self._look_again(module)
            if self.refusal is not None:
                if torch.is_grad_enabled():
                    self._note("recomputed", args, self.refusal, "unsupported")
                return self._natively(module, args, kwargs)
            if self.through is not None:
                return self._natively(module, args, kwargs)
            args, kwargs = bound(named_forward(module), args, kwargs)
            if self._descends(module, args, kwargs):
                return self._natively(module, args, kwargs)
            log, engine = self.engine.log, self.engine
            seen, checks = len(log.records), engine.check_seconds
            try:
                return engine(*args, **kwargs)
            finally:
                made = log.records[seen:]
                self.window.extend(made)
                self.checks += engine.check_seconds - checks
                self._warn_failed_compiles(made)
                if self.native is not None:
                    self._time_natively(module, made, args, kwargs)
        except Exception as error:  # never break a loop that runs natively: run it so, and say why
            if self.refusal is not None or _INSIDE[0] > 1:
                raise
            # The stages that swap the module's tensors (trace, partition, compile) put them back where they raise
            # (runtime.snapshot); the others write nothing to the module
            self.failed(error, stacklevel=4)
            return self._natively(module, args, kwargs)
        finally:
            _INSIDE[0] -= 1

    def failed(self, error: Exception, stacklevel: int) -> None:
        """The engine raised: free what it keeps and run the module natively from now on, saying why."""
        self.refusal = f"the engine failed ({type(error).__name__}: {error}); the module runs natively"
        self.engine.release()
        warnings.warn(f"leancompile.wrap: {self.refusal}", NothingServedWarning, stacklevel=stacklevel)

    def _warn_failed_compiles(self, records: list[CallRecord]) -> None:
        """Say once per error where the per-row program raised while compiling: those calls run natively."""
        for reason in {r.reason for r in records if r.kind == "compile failed"} - self.warned:
            self.warned.add(reason)
            warnings.warn(f"leancompile.wrap: a call was not kept, its program failed: {reason}; it runs natively",
                          NothingServedWarning, stacklevel=4)

    @staticmethod
    def _natively(module: torch.nn.Module, args: tuple, kwargs: dict):
        """The module's own call, outside the engine: a wrapped submodule serves its calls."""
        _INSIDE[0] -= 1
        try:
            return torch.nn.Module.__call__(module, *args, **kwargs)
        finally:
            _INSIDE[0] += 1

    def _note(self, action: str, args: tuple, reason: str, kind: str) -> None:
        record = CallRecord(action, _rows(args), reason, kind)
        self.notes.append(record)
        self.window.append(record)

    def _look_again(self, module: torch.nn.Module) -> None:
        """Where a module anywhere registered tensors or submodules since the last call: whether this module is
        still the one the engine was built on, its tensors under the same names (else it is built anew, and a
        framework that flattens them is refused). A block put under a checkpoint wrapper keeps its parameters but
        not their names, which the per-row program reads them by."""
        if self.registrations == REGISTRATIONS[0]:
            return
        self.registrations = REGISTRATIONS[0]
        now = structure(module)
        if now != self.structure:
            self.refusal = framework_refusal(module, self.request.schedule, self.request.per_block)
            if self.refusal is None:
                # A parameter, buffer or submodule replaced: the engine reads the module's new ones, and the calls
                # kept with the old ones are freed, the change their reason.
                replaced = _replaced(self.structure, now)
                self.engine.release()
                self._build(module)
                self.engine.release(f"{replaced} since they were kept")
            else:  # wrapped before FSDP1 flattened it: say so now, and watch the steps over its new parameters
                self.engine.release()
                self._read_parameters(module)
                warnings.warn(f"leancompile.wrap: {self.refusal}", NothingServedWarning, stacklevel=4)

    def _descends(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether calls like this one are served by a submodule: at the first such call without grad, where the
        module's one-row program is refused (the output is not row-laid: a loss over every row, a mask), the
        submodule holding most of the trainable parameters is wrapped alike and serves them, run natively here."""
        if not (self.descendable or self.below) or not isinstance(self.engine, ReuseEngine) \
                or self.engine.answering_with_leaves_now:
            return False
        call = Call.of(args, kwargs, self.engine.shared)
        if call.refusal is not None:
            return False
        signature = call.signature()
        if signature not in self.refused:
            if torch.is_grad_enabled():
                return False
            refusal = self.engine.program_refusal(call)
            child = (self.below or _largest_trainable_child(module)) if refusal is not None else None
            self.refused[signature] = child is not None
            if child is not None:
                self._descend(child)
                name, submodule = child
                self._note("descended", args, f"calls like this one cannot be kept ({refusal}): its submodule "
                           f"{name} ({type(submodule).__name__}) serves them", "descended")
        return self.refused[signature]

    def _descend(self, child: tuple[str, torch.nn.Module]) -> None:
        """Have the submodule ``child`` (name, module), wrapped alike, serve the calls this runtime runs natively."""
        self.below, submodule = child, child[1]
        if RUNTIME not in submodule.__dict__:
            attach(submodule, self.request)
        submodule.__dict__[RUNTIME].watched = False  # this runtime watches its calls with its own

    def stats(self) -> dict:
        stats = self.engine.take_stats()
        if self.below is not None:
            below = self.below[1].__dict__[RUNTIME].stats()
            reasons = Counter(stats["recompute_reasons"]) + Counter(below["recompute_reasons"])
            stats = {k: stats.get(k, 0) + v for k, v in below.items() if isinstance(v, (int, float))}
            stats.update(recompute_reasons=dict(reasons), served_by=self.below[0])
        stats["stopped"] = self.serving.policy.stopped
        refused = [r for r in self.notes if r.action == "recomputed"]  # run natively by the wrapper (FSDP1)
        if refused:
            stats["recomputed_calls"] += len(refused)
            stats["recomputed_rows"] += sum(r.rows for r in refused)
            stats["recompute_reasons"] = dict(Counter(stats["recompute_reasons"]) + Counter(r.kind for r in refused))
        self.notes = []
        return stats

    def _time_natively(self, module: torch.nn.Module, made: list[CallRecord], args: tuple, kwargs: dict) -> None:
        """auto: native's seconds per row for this call where the program just kept or served it and fewer than
        ``NATIVE_SAMPLES`` such calls were timed: right after the program, so that both run under the same load."""
        for action, native in (("kept", lambda: forward_seconds(module, args, kwargs)),
                               ("served", lambda: update_seconds(module, self.trainable, args, kwargs))):
            rows = sum(r.rows for r in made if r.action == action)
            if rows and len(self.native[action]) < NATIVE_SAMPLES:
                self.native[action].append(native() / rows)

    def _weigh(self, window: list[CallRecord], checks: float, compiled: float) -> None:
        """auto, at the first ``WEIGHED_STEPS`` optimizer steps after served calls: the program's time for the
        window's kept and served rows (each kind's median seconds per row, and the engine's checks) against native's
        for the same rows (its medians, timed beside the program's). The first step's compile is paid once; a later
        weighed step that compiles again (``compiled`` seconds since the last optimizer step: new shapes, or a state
        that differs at every step) counts it, as every step will pay it. Where the program is measured slower
        (:func:`leancompile.runtime.auto.slower`), nothing more is kept: the loop runs natively from then on, and
        says why; otherwise the verdict, with the steps the first compile takes to repay, is noted in
        ``last_calls``."""
        if self.native is None or self.policy.stopped or not all(self.native.values()):
            return
        again = compiled if self.weighed else 0.0
        self.weighed += 1
        rows = {action: sum(r.rows for r in window if r.action == action) for action in self.native}
        native = sum(rows[action] * statistics.median(times) for action, times in self.native.items())
        program = sum(rows[action] * program_seconds_per_row(window, action) for action in rows) + checks + again
        samples = min(map(len, self.native.values()))
        if self.weighed == WEIGHED_STEPS:
            self.native = None
        recompiled = f", {again:.3g} s compiling again" if again else ""
        verdict = (f"auto: this step's {rows['kept']} kept and {rows['served']} served rows took the per-row program "
                   f"{program * 1e3:.3g} ms (forwards and keeps, backwards, checks{recompiled}), native "
                   f"{native * 1e3:.3g} ms (timed beside the program on {samples}+ calls of each): "
                   f"{native / program:.2f}x")
        if not slower(program, native):
            first = self.engine.compiled_seconds
            repaid = f", repaid after {first / (native - program):.0f} such steps" if native > program else ""
            self.notes.append(CallRecord("weighed", 0, f"{verdict}; the compile took {first:.1f} s{repaid}", "auto"))
            return
        self.policy.stop(f"{verdict}, slower than native: the module runs natively from now on")
        self.engine.release(self.policy.stopped)
        self.notes.append(CallRecord("native", 0, self.policy.stopped, "auto"))
        warnings.warn(f"leancompile.wrap: {self.policy.stopped}", NothingServedWarning, stacklevel=5)

    def _stop_keeping(self, with_grad: list[CallRecord], rollouts: int) -> None:
        """The calls kept in the last rollouts served none of the update's: keeping them costs the per-row program's
        time and their memory for nothing, so nothing more is kept and the module runs natively, saying why."""
        kind, reason, fix = _commonest(with_grad)
        self.policy.stop(f"the update served none of the calls kept in the last {rollouts} rollouts ({kind}: "
                         f"{reason}; fix: {fix}): the module runs natively from now on")
        self.engine.release(self.policy.stopped)
        self.notes.append(CallRecord("native", 0, self.policy.stopped, "stopped"))
        message = f"leancompile.wrap: {self.policy.stopped}"
        if self.request.raises:
            raise NothingServedError(message)
        warnings.warn(message, NothingServedWarning, stacklevel=5)

    def _take(self) -> tuple[list[CallRecord], float, float]:
        """The calls since the last optimizer step, here and in the submodules serving for this module, with their
        engines' check and compile seconds in them; the next step's count starts from zero."""
        window, self.window, checks, self.checks = self.window, [], self.checks, 0.0
        compiled, self.compiled = self.engine.compiled_seconds - self.compiled, self.engine.compiled_seconds
        if self.below is not None:
            more = self.below[1].__dict__[RUNTIME]._take()
            window, checks, compiled = window + more[0], checks + more[1], compiled + more[2]
        return window, checks, compiled

    def stepped(self) -> None:
        """An optimizer step over the module's weights: warn once per cause where the calls with grad since the
        previous step were all recomputed (or none was seen while the weights have gradients)."""
        window, checks, compiled = self._take()
        serving = self.serving  # a submodule's, once calls were refused here: it keeps, so auto weighs it
        with_grad = [r for r in window if r.action in ("served", "recomputed")]
        served = sum(r.action == "served" for r in with_grad)
        self.served_ever |= served > 0
        # a window without kept calls (the second optimizer step on one rollout) leaves the count as it is
        self.barren = 0 if served else self.barren + any(r.action == "kept" for r in window)
        if served:
            serving._weigh(window, checks, compiled)
            return
        if serving.policy.stopped:  # auto chose native, or the rollouts' calls served nothing, and it said so
            return
        if with_grad and self.barren >= BARREN_ROLLOUTS:
            serving._stop_keeping(with_grad, self.barren)
            return
        if not with_grad:
            if not any(p.grad is not None for p in self.trainable):
                return
            kind, reason = "no call", ("its parameters have gradients, but no call of the module went through "
                                       "leancompile (the loop calls .forward() directly, or an unwrapped copy)")
            fix = "call the wrapped module itself (module(...))"
        else:
            kind, reason, fix = _commonest(with_grad)
            if kind == "weights" and self.served_ever:  # the second optimizer step on one rollout, as expected
                return
        if kind in self.warned:
            return
        self.warned.add(kind)
        message = (f"leancompile.wrap: an optimizer step followed {len(with_grad)} calls with grad of the wrapped "
                   f"module and none was served: {kind}: {reason}. Fix: {fix}")
        if self.request.raises:
            raise NothingServedError(message)
        warnings.warn(message, NothingServedWarning, stacklevel=4)


def _commonest(records: list[CallRecord]) -> tuple[str, str, str]:
    """The commonest kind of recompute among ``records``, its first reason, and its fix."""
    kind = Counter(r.kind for r in records).most_common(1)[0][0]
    return kind, next(r.reason for r in records if r.kind == kind), FIXES.get(kind, "see last_calls")


def _rows(args: tuple) -> int:
    tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor) and leaf.dim()]
    return tensors[0].shape[0] if tensors else 0


def structure(module: torch.nn.Module) -> dict[str, dict[str, int]]:
    """What the engine was built on: per kind, every submodule, parameter (FSDP2's sharded one, whatever FSDP2 has
    registered now) and buffer by name, and its identity."""
    return {"submodule": {name: id(m) for name, m in module.named_modules(remove_duplicate=False)},
            "parameter": {name: id(p) for name, p in named_weights(module)},
            "buffer": {name: id(b) for name, b in module.named_buffers(remove_duplicate=False)}}


def _replaced(before: dict, after: dict) -> str:
    """The first submodule, parameter or buffer that is not what it was (replaced, added or removed), named."""
    for kind in before:
        for name in (*before[kind], *after[kind]):
            if before[kind].get(name) != after[kind].get(name):
                change = ("replaced" if name in before[kind] and name in after[kind] else
                          "added" if name in after[kind] else "removed")
                return f"{kind} {name or '(the module)'} was {change}"
    return "the module's tensors changed"


def _largest_trainable_child(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The direct submodule holding most of the module's trainable parameters (a decoder under its LM head), where
    one does and is called itself (not a container such as ``nn.ModuleList``)."""
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    children = [(name, child) for name, child in module.named_children()
                if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    best = max(children, key=lambda c: count(c[1]), default=None)
    return best if best is not None and 2 * count(best[1]) > count(module) else None


def attach(module: torch.nn.Module, request: Request) -> WrapRuntime:
    """Route ``module``'s calls through a runtime for ``request``: its class put behind :class:`Wrapped`, the
    runtime in its ``__dict__``, the module watched at optimizer steps."""
    runtime = WrapRuntime(module, request)  # refuses bad settings before the module changes
    untraced()
    module.__class__ = wrapped_class(type(module))
    module.__dict__[RUNTIME] = runtime
    watch(module)
    return runtime


def build_engine(module: torch.nn.Module, request: Request) -> tuple:
    """The engine that serves ``module``'s calls under ``wrap``'s ``request``, and its policy (what it keeps)."""
    schedule, bitwise, shared, tune_matmuls = request.schedule, request.bitwise, request.shared, request.tune_matmuls
    auto = schedule == AUTO
    if auto:  # Retain's runtime: a call kept past the memory limit waits in host memory (offload)
        schedule = str(Schedule.RETAIN)
    sharded = any(fully_sharded(m) or fsdp1_unit(m) for m in module.modules())  # FSDP2 or FSDP1
    per_block = sharded if request.per_block is None else request.per_block
    schedule_runtime = BitwiseRetain() if bitwise else SCHEDULES[Schedule(schedule)].runtime()
    native = functools.partial(torch.nn.Module.__call__, module)  # the module's call, hooks included
    action = StepAction(0, Action(schedule), "a call without grad of the wrapped module that matches no kept call")
    overflow = (StepAction(0, Action.OFFLOAD, "a kept call past the device's memory limit")
                if auto and not bitwise else None)
    # Reweight's heads backpropagate through FSDP2's per-block collectives: every rank must keep the same calls
    agreed = per_block and sharded and schedule == str(Schedule.REWEIGHT)
    policy = RolloutPolicy(action, request.memory_limit, request.trained, overflow, agreed=agreed)
    if per_block:
        if schedule_runtime.for_block() is None:  # bitwise=True under FSDP2 (per_block=True with it: refused)
            raise ValueError("the module is sharded by FSDP2, whose calls are served per block, and bitwise=True "
                             "keeps the eager graph of the whole call: drop bitwise=True")
        # an FSDP1 unit's own forward gathers and frees around the block it wraps, whose forward is routed
        routes = [fsdp1_routed(b) for b in transformer_blocks(module)]
        blocks, checkpoints = [block for block, _ in routes], [wrapper for _, wrapper in routes]
        if not blocks:
            raise ValueError(f"per_block=True: {type(module).__name__} has no stack of identical blocks (an "
                             "nn.ModuleList of modules of one class); use per_block=False")
        family = family_of(module)
        engine = RegionalEngine(module, blocks, schedule_runtime.for_block, tune_matmuls, PassHistory(),
                                shared=family.block_shared if family else (), call_shared=frozenset(shared),
                                policy=policy, verify=request.verify, checkpoints=checkpoints)
    else:
        per_row = {1.0: RowwiseBackbone(module, tune_matmuls=tune_matmuls)}
        engine = ReuseEngine(module, schedule_runtime, per_row, policy, shared=frozenset(shared), native=native,
                             timed=auto, verify=request.verify)
    return engine, policy
