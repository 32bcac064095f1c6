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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cost.devices import free_memory
from .backbones.families import family_of
from .backbones.plain import fully_sharded
from .passes.pipeline import PassHistory
from .plan import Action, Schedule, StepAction
from .runtime.bitwise import BitwiseRetain
from .runtime.calls import Call
from .runtime.engine import ReuseEngine
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

    def __call__(self, call: Call) -> StepAction | None:
        if self.engine.answering_with_leaves_now:  # a provisional head's call (a KL reference): its values are kept
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


class Wrapped(torch.nn.Module):
    """The wrapped module: called like it, with its calls going through the reuse engine. Attributes it does not
    have are the module's (``config``, ``dtype``, ...); ``wrapped.module`` is the module itself (save that one)."""

    def __init__(self, module: torch.nn.Module, engine: ReuseEngine):
        super().__init__()
        self.module = module
        self.__dict__["engine"] = engine  # not a submodule: its state is not the model's

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self.engine.answering_with_leaves_now:
            self.engine.admit.close()
        return self.engine(*args, **kwargs)

    def provisional(self, head: Callable[[float], torch.Tensor]) -> None:
        """``schedule="reweight"``: backpropagate the update's loss through the calls kept since the last time.

        ``head(advantage)`` computes the loss the update will compute for those calls' rows, at that one advantage
        for every row (it is called at 1 and 0), calling this module as the update does; those calls are answered
        with the kept outputs, nothing runs twice. Only each row's direction matters: a head off by a factor per
        row (another normalisation, the advantages' sign) still gives native's gradient, and one that is wrong
        otherwise makes the served calls recompute."""
        schedule = self.engine.schedule
        if not isinstance(schedule, Reweight):
            raise ValueError("provisional: the module was wrapped with schedule="
                             f"{self.engine.admit.action.label!r}; wrap it with schedule='reweight'")
        if not callable(head):
            raise ValueError(f"head must be a callable head(advantage) -> loss; got {type(head).__name__}")
        self.engine.provisional([functools.partial(head, a) for a in schedule.advantages])

    def stats(self) -> dict:
        """Since the last call: calls served and recomputed (with each recompute's reason by kind), the peak bytes
        the kept calls held, and the seconds the checks took."""
        return self.engine.take_stats()

    @property
    def pass_history(self):
        """Every pass run on the per-row program's graphs, in order (:mod:`leancompile.passes.pipeline`)."""
        return self.engine.rowwise[1.0].history

    @property
    def last_calls(self) -> list:
        """What the engine did with each call since ``stats()`` was last read."""
        return list(self.engine.log.records)

    def release(self) -> None:
        """Free every kept call now (they are freed anyway once the weights change)."""
        self.engine.release()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def wrap(module: torch.nn.Module, schedule: str = "retain", memory_limit: int | None = None,
         shared: tuple[str, ...] = SHARED_ARGUMENTS, tune_matmuls: bool = True, bitwise: bool = False,
         per_block: bool | None = None, trained: Callable[[int], bool] | None = None) -> Wrapped:
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

    Returns:
        The wrapped module; put it where the module was (inside ``DistributedDataParallel`` too).
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if isinstance(module, Wrapped):
        raise ValueError("module is already wrapped: wrap the module once (wrapped.module is the original)")
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
    auto = schedule == AUTO
    if auto:  # Retain's runtime: a call kept past the memory limit waits in host memory (offload)
        schedule = str(Schedule.RETAIN)
    if bitwise and schedule != "retain":
        raise ValueError(f"bitwise=True keeps eager graphs on the device: it needs schedule='retain', got "
                         f"schedule={schedule!r}")
    if per_block is not None and not isinstance(per_block, bool):
        raise ValueError(f"per_block must be True, False or None; got {per_block!r}")
    sharded = any(fully_sharded(m) for m in module.modules())
    if per_block is None:
        per_block = sharded
    runtime = BitwiseRetain() if bitwise else SCHEDULES[Schedule(schedule)].runtime()
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
        engine = ReuseEngine(module, runtime,
                             {1.0: RowwiseBackbone(module, tune_matmuls=tune_matmuls)}, shared=frozenset(shared))
    action = StepAction(0, Action(schedule), "a call without grad of the wrapped module that matches no kept call")
    overflow = (StepAction(0, Action.OFFLOAD, "a kept call past the device's memory limit")
                if auto and not bitwise else None)
    # Reweight's heads backpropagate through FSDP2's per-block collectives: every rank must keep the same calls
    agreed = per_block and sharded and schedule == str(Schedule.REWEIGHT)
    engine.admit = _Admission(engine, action, memory_limit, trained, overflow, agreed=agreed)
    return Wrapped(module, engine)
