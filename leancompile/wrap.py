"""``leancompile.wrap(module)``: the reuse engine around a module called from a training loop leancompile did not
write (a diffusers transformer in a FlowGRPO- or DanceGRPO-style script, a causal LM in a GRPO loop).

The loop stays as it is. Its rollout calls the module without grad; each such call that matches no kept call is
kept (run through the per-row program, its saved tensors held) while what the kept calls hold stays under the
memory limit. The rollout ends at the first call with grad (calls without grad after it, such as a KL reference
with the adapters off, are not kept) and a new one begins once the weights change. Its update calls the module
again with grad: a call whose every row has a kept row with bitwise-equal inputs and the same state (weights
unmodified, training flags, adapters, autocast) is served from it, and its backward runs the kept rows' backward;
anything else runs the module itself, and ``stats()`` says why. An optimizer step changes the weights' version
counters, so nothing kept before it is served after it, and it is freed at the next call.

With ``schedule="reweight"`` the loop also hands the update's loss to ``wrapped.provisional(head)`` once the
rollout's calls are made: the kept calls' per-row gradients are computed from it then, their activations freed,
and each served call's backward combines them with the coefficients its true cotangent has in their span (a
cotangent outside it recomputes: :mod:`leancompile.runtime.reweight`).
"""
from __future__ import annotations

import functools
import inspect
import math
import sys
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from .cost.devices import free_memory
from .backbones.families import family_of
from .backbones.plain import WRAPPED_CLASS, fully_sharded
from .passes.pipeline import PassHistory
from .plan import Action, Schedule, StepAction
from .runtime.bitwise import BitwiseRetain
from .runtime.calls import Call, bound, call_signature, output_layout
from .runtime.engine import CallRecord, ReuseEngine
from .runtime.identity import TRAINING_FLAGS
from .runtime.regional import RegionalEngine, transformer_blocks
from .runtime.reweight import Reweight
from .runtime.rowwise import RowwiseBackbone
from .schedules import SCHEDULES

AUTO = "auto"
WRAP_SCHEDULES = (AUTO, *(str(name) for name in SCHEDULES))
# Keyword arguments of diffusers transformers shared by every row whatever their length (position ids).
SHARED_ARGUMENTS = ("img_ids", "txt_ids")


@dataclass
class _Admission:
    """Which calls without grad are kept: those of a rollout (from a change of the weights to the next call with
    grad: a reference model's calls inside the update are not) that ``trained`` allows, while the kept calls hold
    less than ``limit`` bytes (read from the device's free memory at the first call when not given; the last call
    kept may pass it by its own size). Past the limit, ``overflow`` (auto: offload to host memory where the device
    has its own, while the host has room) or nothing."""

    engine: ReuseEngine
    action: StepAction
    limit: int | None
    trained: Callable[[int], bool] | None = None  # by the call's number in its rollout: whether an update trains it
    overflow: StepAction | None = None
    share: float = 0.5  # of the free memory, when no limit is given: the update's own activations need the rest
    closed_at: tuple | None = None  # the weights' versions when a call with grad closed the rollout
    calls: int = 0  # calls of this rollout asked about so far
    host_limit: int | None = None  # bytes the overflow may hold in host memory
    agreed: bool = False  # the limit read from free memory is the least of every rank's (Reweight under FSDP2)
    stopped: str | None = None  # why nothing is kept any more (auto: the program measured slower than native)

    def __call__(self, call: Call) -> StepAction | None:
        if self.engine.answering_with_leaves_now or self.stopped:  # a provisional head's call: its values are kept
            return None
        if self.closed_at is not None:
            if self.engine.reader.versions() == self.closed_at:
                return None
            self.closed_at, self.calls = None, 0  # the weights changed since: a new rollout
        number, self.calls = self.calls, self.calls + 1
        if self.trained is not None and not self.trained(number):
            return None
        if self.limit is None:
            self.limit = int(free_memory(call.device) * self.share)
            if self.agreed and dist.is_initialized():  # every rank keeps the same calls (see wrap's per_block)
                limit = torch.tensor([self.limit], dtype=torch.float64, device=call.device)
                dist.all_reduce(limit, op=dist.ReduceOp.MIN)
                self.limit = int(limit.item())
        if self.engine.held_bytes < self.limit:
            return self.action
        if self.overflow is None or call.device.type == "cpu":  # the host's memory is the device's
            return None
        if self.host_limit is None:
            self.host_limit = int(free_memory(torch.device("cpu")) * self.share)
        return self.overflow if self.engine.held_bytes < self.limit + self.host_limit else None

    def close(self) -> None:
        """A call with grad: the rollout is over until the weights change."""
        self.closed_at = self.engine.reader.versions()


class NothingServedWarning(UserWarning):
    """An optimizer step followed calls with grad of a wrapped module and none of them was served."""


class NothingServedError(RuntimeError):
    """:class:`NothingServedWarning` raised as an error (``wrap(..., strict=True)``)."""


# What to do about each kind of recompute reason, for the warning of a loop that gains nothing.
FIXES = {
    "nothing kept": "no call without grad was kept before the update: the rollout must call the module under "
                    "torch.no_grad() on the rows the update trains (check the trained= hint and memory_limit)",
    "inputs": "the update's call differs from the rollout's in an argument (see last_calls): pass it the rollout's "
              "own tensors, in the same dtype",
    TRAINING_FLAGS: "the rollout and the update run the module in different modes and a submodule computes "
                    "differently in the two (dropout with p > 0): run both in one mode, or set that p to 0",
    "weights": "an optimizer step came between the rollout and the update: only the update's calls before the "
               "first optimizer step after a rollout can be served",
    "autocast": "the update runs under another autocast state than the rollout: use the same one in both",
    "module state": "adapters or requires_grad differ between the rollout and the update (a KL reference runs "
                    "natively by design)",
    "arguments": "an argument is neither a tensor nor a constant",
    "cotangent": "the update's loss is not in the span of the provisional head's: hand provisional() the update's "
                 "own loss",
    "used": "each kept row serves one call with grad before an optimizer step: the update ran the same rows twice",
    "unsupported": "see the reason",
}


class Wrapped(torch.nn.Module):
    """Put in front of the module's class by :func:`wrap`, as FSDP2's ``fully_shard`` puts ``FSDPModule``: the
    module stays itself (``isinstance``, ``state_dict()`` keys, ``save_pretrained``, peft's methods, a ``forward``
    assigned on it), and every call of it goes through the reuse engine."""

    def __call__(self, *args, **kwargs):
        return self.__dict__[_RUNTIME](self, args, kwargs)

    def provisional(self, head: Callable[[float], torch.Tensor]) -> None:
        """``schedule="reweight"``: backpropagate the update's loss through the calls kept since the last time.

        ``head(advantage)`` computes the loss the update will compute for those calls' rows, at that one advantage
        for every row (it is called at 1 and 0), calling this module as the update does; those calls are answered
        with the kept outputs, nothing runs twice. Only each row's direction matters: a head off by a factor per
        row (another normalisation, the advantages' sign) still gives native's gradient, and one that is wrong
        otherwise makes the served calls recompute."""
        runtime = self.__dict__[_RUNTIME].serving
        schedule = runtime.engine.schedule
        if not isinstance(schedule, Reweight):
            raise ValueError("provisional: the module was wrapped with schedule="
                             f"{runtime.admission.action.label!r}; wrap it with schedule='reweight'")
        if not callable(head):
            raise ValueError(f"head must be a callable head(advantage) -> loss; got {type(head).__name__}")
        runtime.engine.provisional([functools.partial(head, a) for a in schedule.advantages])

    def stats(self) -> dict:
        """Since the last call: calls with grad served (``served_calls``) and recomputed (with each recompute's
        reason by kind), calls without grad answered with kept values (``served_values``), the peak bytes the kept
        calls held, and the seconds the checks took; ``served_by``: the submodule that serves, where the module's
        own calls could not be kept."""
        return self.__dict__[_RUNTIME].stats()

    @property
    def engine(self):
        """The reuse engine that serves this module's calls (a submodule's, after a descent)."""
        return self.__dict__[_RUNTIME].serving.engine

    @property
    def pass_history(self):
        """Every pass run on the per-row program's graphs, in order (:mod:`leancompile.passes.pipeline`)."""
        return self.engine.rowwise[1.0].history

    @property
    def last_calls(self) -> list:
        """What the engine did with each call since ``stats()`` was last read."""
        runtime = self.__dict__[_RUNTIME]
        return [*runtime.notes, *runtime.serving.engine.log.records]

    def release(self) -> None:
        """Free every kept call now (they are freed anyway once the weights change)."""
        self.__dict__[_RUNTIME].serving.engine.release()


_RUNTIME = "_leancompile_runtime"
_CLASSES: dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    """The module's class with :class:`Wrapped` in front, one per class (as FSDP2 makes ``FSDP<class>``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Wrapped{cls.__name__}", (Wrapped, cls), {"__module__": cls.__module__,
                                                                        WRAPPED_CLASS: True})
    return _CLASSES[cls]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`wrap`: the module's own class again, nothing kept. Returns the module."""
    if _RUNTIME not in module.__dict__:
        raise ValueError(f"unwrap: {type(module).__name__} is not wrapped by leancompile.wrap")
    if not type(module).__dict__.get(WRAPPED_CLASS):
        raise ValueError(f"unwrap: {type(module).__name__} was given another class since it was wrapped (FSDP2's "
                         "fully_shard): unwrap it before that")
    runtime = module.__dict__.pop(_RUNTIME)
    runtime.engine.release()
    if runtime.below is not None:
        unwrap(runtime.below[1])
    module.__class__ = type(module).__bases__[-1]
    return module


# Bumped whenever any module registers a parameter, buffer or submodule: a wrapped module whose own tensors may
# have changed (FSDP1 flattening them, peft adding adapters) looks again at its next call.
_REGISTRATIONS = [0]


def _registered(*_):
    _REGISTRATIONS[0] += 1


# Calls made while an engine runs (its native calls, its traces) run the module itself, a wrapped submodule too.
_INSIDE = [0]


class _Runtime:
    """What a wrapped module's calls go through: the engine, what it keeps (the admission), the checks that a
    framework around the module has not taken its parameters over, the submodule that serves the calls the module's
    own program cannot keep, and the watch for a loop that gains nothing."""

    def __init__(self, module: torch.nn.Module, options: dict, strict: bool):
        self.options, self.strict = options, strict
        self.notes: list[CallRecord] = []  # what the wrapper itself decided (a refusal, a descent)
        self.below: tuple[str, torch.nn.Module] | None = None  # (name, submodule) serving the calls refused here
        self.refused: dict[tuple, bool] = {}  # per call signature: whether the submodule serves such calls
        self.window: list[CallRecord] = []  # the calls since the last optimizer step over the module's weights
        self.served_ever = False
        self.warned: set[str] = set()
        self.watched = True  # by the optimizer-step watch (a submodule serving after a descent: by its parent's)
        self.refusal = _framework_refusal(module)
        self._build(module)

    def _read_parameters(self, module: torch.nn.Module) -> None:
        """The module's parameters as they are now: which the engine reads, which the optimizer-step watch follows,
        and whether a submodule could serve calls this module's program cannot keep."""
        self.registrations, self.parameters = _REGISTRATIONS[0], [id(p) for p in module.parameters()]
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.descendable = _largest_trainable_child(module) is not None

    def _build(self, module: torch.nn.Module) -> None:
        self._read_parameters(module)
        self.engine, self.admission = _engine(module, **self.options)
        # auto: native's time per row for a kept call without grad and again with grad and its backward, measured
        # at the first kept call and compared with the program's own once calls were served (nan: not measured;
        # the whole-call engine only)
        auto = self.options["schedule"] == AUTO and isinstance(self.engine, ReuseEngine)
        self.native_seconds: float | None = None if auto else math.nan

    @property
    def serving(self) -> "_Runtime":
        """The runtime whose engine serves: this one's, or the submodule's once this one's calls were refused."""
        return self.below[1].__dict__[_RUNTIME].serving if self.below is not None else self

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
            args, kwargs = bound(_named_forward(module), args, kwargs)
            if self._descends(module, args, kwargs):
                return self._natively(module, args, kwargs)
            log = self.engine.log
            seen = len(log.records)
            if torch.is_grad_enabled() and not self.engine.answering_with_leaves_now:
                self.admission.close()
            try:
                return self.engine(*args, **kwargs)
            finally:
                made = log.records[seen:]
                self.window.extend(made)
                if self.native_seconds is None and any(r.action == "kept" for r in made):
                    self.native_seconds = _native_seconds(module, self.trainable, args, kwargs)
        except Exception as error:  # never break a loop that runs natively: run it so, and say why
            if self.refusal is not None or _INSIDE[0] > 1:
                raise
            self.refusal = f"the engine failed ({type(error).__name__}: {error}); the module runs natively"
            self.engine.release()
            warnings.warn(f"leancompile.wrap: {self.refusal}", NothingServedWarning, stacklevel=3)
            return self._natively(module, args, kwargs)
        finally:
            _INSIDE[0] -= 1

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
        """Where a module anywhere registered tensors since the last call: whether this module's parameters are
        still the ones the engine reads (else it is built anew, and a framework that flattens them is refused)."""
        if self.registrations == _REGISTRATIONS[0]:
            return
        self.registrations = _REGISTRATIONS[0]
        if [id(p) for p in module.parameters()] != self.parameters:
            self.refusal = _framework_refusal(module)
            if self.refusal is None:
                self.engine.release()
                self._build(module)
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
                name, submodule = self.below = child
                if _RUNTIME not in submodule.__dict__:
                    wrap(submodule, strict=self.strict, **self.options)
                submodule.__dict__[_RUNTIME].watched = False  # this runtime watches its calls with its own
                self._note("descended", args, f"calls like this one cannot be kept ({refusal}): its submodule "
                           f"{name} ({type(submodule).__name__}) serves them", "descended")
        return self.refused[signature]

    def stats(self) -> dict:
        stats = self.engine.take_stats()
        if self.below is not None:
            below = self.below[1].__dict__[_RUNTIME].stats()
            reasons = Counter(stats["recompute_reasons"]) + Counter(below["recompute_reasons"])
            stats = {k: stats.get(k, 0) + v for k, v in below.items() if isinstance(v, (int, float))}
            stats.update(recompute_reasons=dict(reasons), served_by=self.below[0])
        if self.admission.stopped:
            stats["auto"] = self.admission.stopped
        refused = [r for r in self.notes if r.action == "recomputed"]  # run natively by the wrapper (FSDP1)
        if refused:
            stats["recomputed_calls"] += len(refused)
            stats["recomputed_rows"] += sum(r.rows for r in refused)
            stats["recompute_reasons"] = dict(Counter(stats["recompute_reasons"]) + Counter(r.kind for r in refused))
        self.notes = []
        return stats

    def _weigh(self, window: list[CallRecord]) -> None:
        """auto, at the first optimizer step after served calls: where the program's own time per row (a kept call's
        forward and its served backward, each past its first, which traces) is above native's by more than
        ``AUTO_FLOOR`` allows, keep nothing more: the loop runs natively from then on, and says why."""
        if self.native_seconds is None or math.isnan(self.native_seconds) or self.admission.stopped:
            return
        per_row = []
        for action in ("kept", "served"):
            records = [r for r in window if r.action == action and r.seconds > 0]
            records = records[1:] or records
            per_row.append(sum(r.seconds for r in records) / max(sum(r.rows for r in records), 1))
        program, native = sum(per_row), self.native_seconds
        self.native_seconds = math.nan  # weighed once
        if program * AUTO_FLOOR > native:
            self.admission.stopped = (f"auto: the per-row program took {program * 1e3:.3g} ms a row (kept forward "
                                      f"and served backward), native {native * 1e3:.3g} ms a row (forward without "
                                      "grad, forward and backward with grad): the module runs natively from now on")
            self.engine.release()
            self.notes.append(CallRecord("native", 0, self.admission.stopped, "auto"))
            warnings.warn(f"leancompile.wrap: {self.admission.stopped}", NothingServedWarning, stacklevel=5)

    def stepped(self) -> None:
        """An optimizer step over the module's weights: warn once per cause where the calls with grad since the
        previous step were all recomputed (or none was seen while the weights have gradients)."""
        window, self.window = self.window, []
        if self.below is not None:
            below = self.below[1].__dict__[_RUNTIME]
            window, below.window = window + below.window, []
        with_grad = [r for r in window if r.action in ("served", "recomputed")]
        served = sum(r.action == "served" for r in with_grad)
        self.served_ever |= served > 0
        if served:
            self._weigh(window)
            return
        if self.admission.stopped:  # auto chose native, and said so
            return
        if not with_grad:
            if not any(p.grad is not None for p in self.trainable):
                return
            kind, reason = "no call", ("its parameters have gradients, but no call of the module went through "
                                       "leancompile (the loop calls .forward() directly, or an unwrapped copy)")
            fix = "call the wrapped module itself (module(...))"
        else:
            kind = Counter(r.kind for r in with_grad).most_common(1)[0][0]
            reason = next(r.reason for r in with_grad if r.kind == kind)
            fix = FIXES.get(kind, "see last_calls")
            if kind == "weights" and self.served_ever:  # the second optimizer step on one rollout, as expected
                return
        if kind in self.warned:
            return
        self.warned.add(kind)
        message = (f"leancompile.wrap: an optimizer step followed {len(with_grad)} calls with grad of the wrapped "
                   f"module and none was served: {kind}: {reason}. Fix: {fix}")
        if self.strict:
            raise NothingServedError(message)
        warnings.warn(message, NothingServedWarning, stacklevel=4)


def _named_forward(module: torch.nn.Module):
    """The forward whose signature names the call's arguments: a pass-through ``forward(*args, **kwargs)`` (peft's
    ``PeftModel``, DDP) binds as the module it hands them to, so that ``x=None`` passed and omitted are one call."""
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        forward = module.forward
        signature = call_signature(forward)
        if signature is None:
            return forward
        if not {p.kind for p in signature.parameters.values()} <= {inspect.Parameter.VAR_POSITIONAL,
                                                                    inspect.Parameter.VAR_KEYWORD}:
            return forward
        inner = module.get_base_model() if hasattr(module, "get_base_model") else getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return forward
        module = inner
    return module.forward


# auto keeps running the per-row program while it is measured at least this fast relative to native
AUTO_FLOOR = 0.97


def _native_seconds(module: torch.nn.Module, trainable: list, args: tuple, kwargs: dict) -> float:
    """Native's time per row for this call: once without grad (the rollout's) and once with grad and its backward
    (the update's), the gradients returned, not accumulated (nothing of the loop's state changes)."""
    cuda = lambda: torch.cuda.synchronize() if torch.cuda.is_available() else None  # noqa: E731
    cuda()
    start = time.perf_counter()
    with torch.no_grad():
        torch.nn.Module.__call__(module, *args, **kwargs)
    with torch.enable_grad():
        output, _, refusal = output_layout(torch.nn.Module.__call__(module, *args, **kwargs))
        if refusal is None and output.requires_grad:
            torch.autograd.grad(output, [p for p in trainable if p.requires_grad], torch.ones_like(output),
                                allow_unused=True)
    cuda()
    return (time.perf_counter() - start) / max(_rows(args), 1)


def _rows(args: tuple) -> int:
    tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor) and leaf.dim()]
    return tensors[0].shape[0] if tensors else 0


def _largest_trainable_child(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The direct submodule holding most of the module's trainable parameters (a decoder under its LM head), where
    one does and is called itself (not a container such as ``nn.ModuleList``)."""
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    children = [(name, child) for name, child in module.named_children()
                if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    best = max(children, key=lambda c: count(c[1]), default=None)
    return best if best is not None and 2 * count(best[1]) > count(module) else None


def _framework_refusal(module: torch.nn.Module) -> str | None:
    """Why a framework that manages the module's parameters itself keeps it from being served (None: none does)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is not None and (any(isinstance(m, fsdp.FullyShardedDataParallel) for m in module.modules()) or any(
            isinstance(p, fsdp.FlatParameter) for p in module.parameters())):
        return ("FSDP1 (FullyShardedDataParallel) holds the module's parameters as flat shards it swaps in and out "
                "around each call, which the engine cannot verify; it runs natively. Shard with FSDP2's "
                "fully_shard (torch.distributed.fsdp) to be served per block")
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return ("DeepSpeed ZeRO-3 partitions the module's parameters and gathers them inside each call; it runs "
                "natively. ZeRO-1 and ZeRO-2 (sharded gradients and optimizer states) are served")
    return None


_OPTIMIZER_HOOK = []


def _watch(module: torch.nn.Module) -> None:
    """Register the module for the optimizer-step watch (one global hook for every wrapped module)."""
    _WATCHED.add(module)
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_optimizer_step))
        for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                         register_module_module_registration_hook):
            register(_registered)


_WATCHED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _optimizer_step(optimizer, *_):
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in list(_WATCHED):
        runtime = module.__dict__.get(_RUNTIME)
        if runtime is not None and runtime.watched and any(id(p) in stepped for p in runtime.trainable):
            runtime.stepped()


def wrap(module: torch.nn.Module, schedule: str = "retain", memory_limit: int | None = None,
         shared: tuple[str, ...] = SHARED_ARGUMENTS, tune_matmuls: bool = True, bitwise: bool = False,
         per_block: bool | None = None, trained: Callable[[int], bool] | None = None,
         strict: bool = False) -> Wrapped:
    """Wrap ``module`` so that its calls with grad are served from its earlier calls without grad where that is
    verified to compute the same thing.

    Args:
        module: any ``nn.Module`` whose output rows depend only on the same rows of its inputs (a diffusers
            transformer, with or without peft LoRA; a causal LM called on whole sequences), called with its own
            arguments. Its output must be tensors with the call's rows first, of one dtype, and constants, in any
            tree (``return_dict=False``'s tuple, a model output without a cache: pass ``use_cache=False`` to a
            causal LM).
        schedule: ``"retain"`` keeps the kept calls' activations on the device, ``"offload"`` in host memory;
            ``"reweight"`` turns them into per-row gradients when the loop calls ``wrapped.provisional(head)``;
            ``"auto"`` retains while the kept calls fit in ``memory_limit``, then offloads where the device has a
            memory of its own (CUDA: the host's has room), else runs the rest natively.
        memory_limit: bytes the kept calls may hold on the device (default: half the device's free memory at the
            first call).
        shared: keyword arguments that every row shares whatever their leading size (tensors whose leading size
            differs from the batch's are shared anyway).
        tune_matmuls: as in :func:`leancompile.optimize`.
        bitwise: ``schedule="retain"`` keeping the module's own eager autograd graph (:mod:`leancompile.runtime.bitwise`):
            the loop's run is native's bit for bit in any precision; an update call is served only when it holds
            exactly one kept call's rows in their order.
        per_block: keep and serve each transformer block's calls through an engine of its own while the rest of
            the module runs natively (:mod:`leancompile.runtime.regional`; the blocks are the module's stacks of
            identical blocks, :func:`~leancompile.runtime.regional.transformer_blocks`), so that FSDP2's per-block
            gathers and reduce-scatters run as they do natively: a module sharded with ``fully_shard`` is never
            gathered whole. ``None``: per block when a submodule of ``module`` is sharded by FSDP2. Not with
            ``bitwise=True``; under Reweight each block keeps its per-row gradients as FSDP2 gathers them (whole
            per block, unreduced: see :mod:`leancompile.runtime.reweight_blocks`).
        trained: a hint where the loop knows which of a rollout's calls its update will train: ``trained(n)`` for
            the rollout's n-th call without grad (from 0, counted from the first call after the weights changed),
            False for a call that is not to be kept (FlowGRPO's steps past the first k of each sample batch:
            ``lambda n: n % num_steps < k``). None: every call is kept while they fit (DanceGRPO draws its trained
            steps after the rollout).
        strict: raise :class:`NothingServedError` where the warning :class:`NothingServedWarning` would be given
            (an optimizer step after calls with grad none of which was served), e.g. in CI.

    Returns:
        The module itself, its class put behind :class:`Wrapped` (``isinstance`` holds, its ``state_dict`` keys
        are its own); wrap it before or after DDP, FSDP2, accelerate's ``prepare`` or peft. A framework that
        manages the parameters itself (FSDP1, DeepSpeed ZeRO-3) runs it natively, and ``stats()`` says so.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if isinstance(module, Wrapped):
        raise ValueError("module is already wrapped: wrap it once (leancompile.unwrap(module) undoes it)")
    if schedule not in WRAP_SCHEDULES:
        raise ValueError(f"schedule must be one of {WRAP_SCHEDULES} for a wrapped module; got {schedule!r}")
    if trained is not None and not callable(trained):
        raise ValueError(f"trained must be a callable trained(n) -> bool on a rollout's n-th call; got {trained!r}")
    if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
        raise ValueError(f"memory_limit must be a positive number of bytes; got {memory_limit!r}")
    if isinstance(shared, str) or not all(isinstance(name, str) for name in shared):
        raise ValueError(f"shared must be a tuple of keyword-argument names; got {shared!r}")
    if not isinstance(tune_matmuls, bool):
        raise ValueError(f"tune_matmuls must be True or False; got {tune_matmuls!r}")
    if not isinstance(bitwise, bool):
        raise ValueError(f"bitwise must be True or False; got {bitwise!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False; got {strict!r}")
    if bitwise and schedule not in ("retain", AUTO):
        raise ValueError(f"bitwise=True keeps eager graphs on the device: it needs schedule='retain', got "
                         f"schedule={schedule!r}")
    if per_block is not None and not isinstance(per_block, bool):
        raise ValueError(f"per_block must be True, False or None; got {per_block!r}")
    options = dict(schedule=schedule, memory_limit=memory_limit, shared=tuple(shared), tune_matmuls=tune_matmuls,
                   bitwise=bitwise, per_block=per_block, trained=trained)
    runtime = _Runtime(module, options, strict)  # refuses bad settings before the module changes
    module.__class__ = _wrapped_class(type(module))
    module.__dict__[_RUNTIME] = runtime
    _watch(module)
    if runtime.refusal is not None:
        warnings.warn(f"leancompile.wrap: {runtime.refusal}", NothingServedWarning, stacklevel=2)
    return module


def _engine(module: torch.nn.Module, schedule: str, memory_limit: int | None, shared: tuple[str, ...],
            tune_matmuls: bool, bitwise: bool, per_block: bool | None, trained):
    """The engine that serves ``module``'s calls under ``wrap``'s options, and what it keeps."""
    auto = schedule == AUTO
    if auto:  # Retain's runtime: a call kept past the memory limit waits in host memory (offload)
        schedule = str(Schedule.RETAIN)
    sharded = any(fully_sharded(m) for m in module.modules())
    if per_block is None:
        per_block = sharded
    runtime = BitwiseRetain() if bitwise else SCHEDULES[Schedule(schedule)].runtime()
    native = functools.partial(torch.nn.Module.__call__, module)  # the module's call, hooks included
    if per_block:
        if runtime.for_block() is None:
            raise ValueError(f"per_block=True serves each block's input gradient, which schedule={schedule!r}"
                             f"{' with bitwise=True' if bitwise else ''} does not keep: use schedule='retain', "
                             "'offload' or 'reweight' without bitwise, or per_block=False")
        blocks = transformer_blocks(module)
        if not blocks:
            raise ValueError(f"per_block=True: {type(module).__name__} has no stack of identical blocks (an "
                             "nn.ModuleList of modules of one class); use per_block=False")
        family = family_of(module)
        engine = RegionalEngine(module, blocks, runtime.for_block, tune_matmuls, PassHistory(),
                                shared=family.block_shared if family else (), call_shared=frozenset(shared))
    else:
        engine = ReuseEngine(module, runtime, {1.0: RowwiseBackbone(module, tune_matmuls=tune_matmuls)},
                             shared=frozenset(shared), native=native, timed=auto)
    action = StepAction(0, Action(schedule), "a call without grad of the wrapped module that matches no kept call")
    overflow = (StepAction(0, Action.OFFLOAD, "a kept call past the device's memory limit")
                if auto and not bitwise else None)
    # Reweight's heads backpropagate through FSDP2's per-block collectives: every rank must keep the same calls
    agreed = per_block and sharded and schedule == str(Schedule.REWEIGHT)
    admission = _Admission(engine, action, memory_limit, trained, overflow, agreed=agreed)
    engine.admit = admission
    return engine, admission
