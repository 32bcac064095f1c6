"""The runtime behind a wrapped module (:func:`leancompile.wrap`): the engine and its policy built from the
wrapper's request, the checks that no framework took the module's parameters over, the descent to a submodule
where the module's own program cannot keep its calls or where a wrapper (DDP) must run its own forward around
them, auto's trial against native (:mod:`..runtime.auto_trial`), and the look back at each optimizer step
(:mod:`.watch`)."""
from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch
from torch.utils import _pytree as pytree

from ..backbones.families import family_of
from ..backbones.plain import (fsdp1_routed, fsdp1_unit, fully_sharded, named_weights, zero3_partitioned,
                               zero3_sharded)
from ..passes.pipeline import PassHistory
from ..plan import AUTO, Action, Schedule, StepAction
from ..request import Request
from ..runtime import auto
from ..runtime.bitwise import BitwiseRetain
from ..runtime.calls import Call, bound, named_forward
from ..runtime.engine import CallRecord, ReuseEngine
from ..runtime.frameworks import framework_refusal, passed_through
from ..runtime.policy import RolloutPolicy
from ..runtime.regional import RegionalEngine, transformer_blocks
from ..runtime.rowwise import RowwiseBackbone
from ..schedules import SCHEDULES
from ..runtime.auto_trial import Trial, Verdict
from .watch import FIXES, REGISTRATIONS, NothingServedError, NothingServedWarning, watch
from .wrapped import RUNTIME, untraced, wrapped_class


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
        # auto: its trial of the program against native over whole cycles of the loop, until its verdict (None where
        # the floor is 0: auto never falls back); a rollout begins at a call without grad right after a step (a
        # reference computed without grad inside the update comes after a call with grad)
        self.trial = Trial() if request.schedule == AUTO and auto.AUTO_FLOOR > 0 else None
        self.rollout_due = True
        self.watched = True  # by the optimizer-step watch (a submodule serving after a descent: by its parent's)
        self.refusal = framework_refusal(module, request.schedule, request.per_block, request.verify)
        self._build(module)
        # DDP: its own forward runs around every call and the module it holds serves them (passed_through)
        self.through = passed_through(module)
        if self.through is not None:
            self._descend(self.through)

    def _read_parameters(self, module: torch.nn.Module) -> None:
        """The module's parameters as they are now: which the engine reads, which the optimizer-step watch follows,
        and whether a submodule could serve calls this module's program cannot keep."""
        self.registrations, self.structure = REGISTRATIONS[0], structure(module)
        self.partitioned = _partitioned(module)
        self.trainable = [p for _, p in named_weights(module) if p.requires_grad]
        self.descendable = _largest_trainable_child(module) is not None

    def _build(self, module: torch.nn.Module) -> None:
        self._read_parameters(module)
        self.engine, self.policy = build_engine(module, self.request)
        for engine in getattr(self.engine, "engines", (self.engine,)):  # a served backward that raises
            engine.failed = functools.partial(self.failed, stacklevel=2)

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
            # Stopped for good (auto's verdict, rollouts that served nothing): nothing is kept or served again, so
            # the module's structure is not looked at again either (TRL registers modules every step)
            if self.refusal is None and self._stopped():
                if torch.is_grad_enabled():
                    self._note("recomputed", args, self.serving.policy.stopped, "stopped")
                return torch.nn.Module.__call__(module, *args, **kwargs)
            self._look_again(module)
            if self.refusal is not None:
                if torch.is_grad_enabled():
                    self._note("recomputed", args, self.refusal, "unsupported")
                return self._natively(module, args, kwargs)
            if self._tried_natively():  # every wrapped module inside runs natively too (_INSIDE)
                return torch.nn.Module.__call__(module, *args, **kwargs)
            if self.through is not None:
                return self._natively(module, args, kwargs)
            args, kwargs = bound(named_forward(module), args, kwargs)
            if self._descends(module, args, kwargs):
                return self._natively(module, args, kwargs)
            log, engine = self.engine.log, self.engine
            seen = len(log.records)
            try:
                return engine(*args, **kwargs)
            finally:
                made = log.records[seen:]
                self.window.extend(made)
                self._warn_failed_compiles(made)
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
        not their names, which the per-row program reads them by. DeepSpeed ZeRO-3 partitions the parameters in
        place, registering nothing: the first parameter shows it."""
        partitioned = _partitioned(module)
        if self.registrations == REGISTRATIONS[0] and self.partitioned == partitioned:
            return
        self.registrations, self.partitioned = REGISTRATIONS[0], partitioned
        now = structure(module)
        if now != self.structure:
            self.refusal = framework_refusal(module, self.request.schedule, self.request.per_block,
                                             self.request.verify)
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
        below = submodule.__dict__[RUNTIME]
        below.watched, below.trial = False, None  # this runtime watches its calls, and tries auto's cycles

    def stats(self) -> dict:
        stats = self.engine.take_stats()
        if self.below is not None:
            below = self.below[1].__dict__[RUNTIME].stats()
            reasons = Counter(stats["recompute_reasons"]) + Counter(below["recompute_reasons"])
            stats = {k: stats.get(k, 0) + v for k, v in below.items() if isinstance(v, (int, float))}
            stats.update(recompute_reasons=dict(reasons), served_by=self.below[0])
        stats["stopped"] = self.serving.policy.stopped
        stats["trying"] = self.trial is not None  # auto's trial still runs: the cycles alternate native and program
        refused = [r for r in self.notes if r.action == "recomputed"]  # run natively by the wrapper (FSDP1)
        if refused:
            stats["recomputed_calls"] += len(refused)
            stats["recomputed_rows"] += sum(r.rows for r in refused)
            stats["recompute_reasons"] = dict(Counter(stats["recompute_reasons"]) + Counter(r.kind for r in refused))
        self.notes = []
        return stats

    def _tried_natively(self) -> bool:
        """auto's trial (:mod:`..runtime.auto_trial`): where a rollout begins, the cycle before it ends; whether this
        call's cycle runs natively, outside every engine. At the verdict, the program keeps serving or, measured
        slower, nothing more is kept and the loop runs natively from then on, saying why."""
        if self.trial is None:
            return False
        if self.rollout_due and torch.is_grad_enabled():  # the update goes on after a step: no rollout began
            self.rollout_due = False
        elif self.rollout_due:
            self.rollout_due = False
            serving = self.serving
            if not isinstance(serving.engine, ReuseEngine) or serving.policy.stopped:  # per block, or stopped
                self.trial = None
                return False
            verdict = self.trial.rollout(auto.now(), serving.engine.compiled_seconds)
            if verdict is not None:
                self.trial = None
                self._decide(serving, verdict)
                return False
        return self.trial.native

    def _stopped(self) -> bool:
        """Whether nothing is kept any more (auto's verdict, or rollouts that served nothing) and the call may run
        natively outside the engine, whose lookups and checks would cost every call for nothing (not while a
        provisional head runs: its calls are the engine's)."""
        serving = self.serving
        return (serving.policy.stopped is not None and isinstance(serving.engine, ReuseEngine)
                and not serving.engine.answering_with_leaves_now)

    def _decide(self, serving: "WrapRuntime", verdict: Verdict) -> None:
        if verdict.keeps:
            self.notes.append(CallRecord("weighed", 0, str(verdict), "auto"))
            return
        serving.policy.stop(str(verdict))
        serving.engine.release(serving.policy.stopped)
        self.notes.append(CallRecord("native", 0, serving.policy.stopped, "auto"))
        warnings.warn(f"leancompile.wrap: {serving.policy.stopped}", NothingServedWarning, stacklevel=6)

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

    def _take(self) -> list[CallRecord]:
        """The calls since the last optimizer step, here and in the submodules serving for this module; the next
        step's start empty."""
        window, self.window = self.window, []
        return window + self.below[1].__dict__[RUNTIME]._take() if self.below is not None else window

    def stepped(self) -> None:
        """An optimizer step over the module's weights: warn once per cause where the calls with grad since the
        previous step were all recomputed (or none was seen while the weights have gradients)."""
        window, serving = self._take(), self.serving  # a submodule's, once calls were refused here
        self.rollout_due = True
        if self.trial is not None and self.trial.native:  # auto's trial ran this cycle natively, on purpose
            return
        with_grad = [r for r in window if r.action in ("served", "recomputed")]
        served = sum(r.action == "served" for r in with_grad)
        self.served_ever |= served > 0
        # a window without kept calls (the second optimizer step on one rollout) leaves the count as it is
        self.barren = 0 if served else self.barren + any(r.action == "kept" for r in window)
        if served:
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
            # the second optimizer step on one rollout, as expected (ZeRO-3's steps move no version counter: the
            # digest sees them)
            if self.served_ever and (kind == "weights" or (kind == "written" and self.partitioned)):
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


def structure(module: torch.nn.Module) -> dict[str, dict[str, object]]:
    """What the engine was built on: per kind, every submodule, parameter (FSDP2's sharded one, whatever FSDP2 has
    registered now) and buffer by name, and its identity (a parameter's with whether ZeRO-3 partitioned it)."""
    return {"submodule": {name: id(m) for name, m in module.named_modules(remove_duplicate=False)},
            "parameter": {name: (id(p), zero3_partitioned(p)) for name, p in named_weights(module)},
            "buffer": {name: id(b) for name, b in module.named_buffers(remove_duplicate=False)}}


def _replaced(before: dict, after: dict) -> str:
    """The first submodule, parameter or buffer that is not what it was (replaced, added or removed), named."""
    for kind in before:
        for name in (*before[kind], *after[kind]):
            if before[kind].get(name) != after[kind].get(name):
                change = ("added" if name not in before[kind] else "removed" if name not in after[kind] else
                          "partitioned by DeepSpeed ZeRO-3" if kind == "parameter" and before[kind][name][0] ==
                          after[kind][name][0] else "replaced")
                return f"{kind} {name or '(the module)'} was {change}"
    return "the module's tensors changed"


def _partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned ``module``'s parameters (it partitions all of them at once)."""
    return zero3_partitioned(next(module.parameters(), None))


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
    sharded = (any(fully_sharded(m) or fsdp1_unit(m) for m in module.modules())  # FSDP2, FSDP1 or ZeRO-3
               or zero3_sharded(module))
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
                             verify=request.verify)
    return engine, policy
