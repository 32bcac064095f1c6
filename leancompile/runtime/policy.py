"""What an engine keeps: one policy object, handed to the engine when it is made, asked at each call.

Two policies, one per way in:

* :class:`StepPolicy` (``optimize``, and each block's engine under :mod:`.regional`): the caller knows, step by
  step, which calls its update trains and says so around them (``keeping(action)``, ``passing()``), from its plan.
* :class:`RolloutPolicy` (``wrap``): the loop says nothing; a rollout's calls without grad that match no kept call
  are kept while what is kept fits a memory limit, from a change of the weights to the first call with grad.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..cost.devices import free_memory
from ..plan import StepAction
from .calls import Call


@dataclass(frozen=True)
class Directive:
    """What the caller said of the calls made now: keep each under ``keep`` (and list them in ``made``); or,
    ``unchecked``, run those without grad natively without looking them up (nothing of them is kept and none
    repeats a kept call)."""

    keep: StepAction | None = None
    unchecked: bool = False
    made: list | None = field(default=None, compare=False)


LOOK_UP = Directive()  # nothing said: look each call up


class KeepPolicy:
    """Asked by an engine of every call (see :class:`ReuseEngine`)."""

    def directive(self) -> Directive:
        """What the caller says of the calls made now."""
        return LOOK_UP

    def unmatched(self, call: Call, engine) -> StepAction | None:
        """The action to keep ``call`` (without grad, matching no kept call) under; None: run it natively."""
        return None

    def closed(self, engine) -> None:
        """A call with grad (outside provisional heads) reached ``engine``."""


class StepPolicy(KeepPolicy):
    """The caller says which calls to keep, around them."""

    def __init__(self):
        self._now = LOOK_UP

    def directive(self) -> Directive:
        return self._now

    @contextlib.contextmanager
    def keeping(self, action: StepAction):
        """Keep the calls made inside under the plan's ``action`` (its ``kind`` and ``fraction``). Yields the list
        of the calls kept."""
        self._now = Directive(keep=action, made=[])
        try:
            yield self._now.made
        finally:
            self._now = LOOK_UP

    @contextlib.contextmanager
    def passing(self):
        """Run the calls made inside without grad natively, unchecked: the caller knows nothing of them is kept
        (a rollout step no update trains) and none repeats a kept call, so there is nothing to verify."""
        self._now = Directive(unchecked=True)
        try:
            yield
        finally:
            self._now = LOOK_UP


@dataclass
class RolloutPolicy(KeepPolicy):
    """Which calls without grad are kept: those of a rollout (from a change of the weights to the next call with
    grad: a reference model's calls inside the update are not) that ``trained`` allows, while the kept calls hold
    less than ``limit`` bytes (read from the device's free memory at the first call when not given; the last call
    kept may pass it by its own size). Past the limit, ``overflow`` (offload to host memory where the device has its
    own, while the host has room) or nothing."""

    action: StepAction
    limit: int | None
    trained: Callable[[int], bool] | None = None  # by the call's number in its rollout: whether an update trains it
    overflow: StepAction | None = None
    share: float = 0.5  # of the free memory, when no limit is given: the update's own activations need the rest
    agreed: bool = False  # the limit read from free memory is the least of every rank's (Reweight under FSDP2)
    closed_at: tuple | None = None  # the weights' writes seen when a call with grad closed the rollout
    calls: int = 0  # calls of this rollout asked about so far
    host_limit: int | None = None  # bytes the overflow may hold in host memory
    stopped: str | None = None  # why nothing is kept any more (auto: the program measured slower than native)

    def unmatched(self, call: Call, engine) -> StepAction | None:
        if engine.answering_with_leaves_now or self.stopped:  # a provisional head's call: its values are kept
            return None
        if self.closed_at is not None:
            if engine.reader.writes() == self.closed_at:
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
        if engine.held_bytes < self.limit:
            return self.action
        if self.overflow is None or call.device.type == "cpu":  # the host's memory is the device's
            return None
        if self.host_limit is None:
            self.host_limit = int(free_memory(torch.device("cpu")) * self.share)
        return self.overflow if engine.held_bytes < self.limit + self.host_limit else None

    def stop(self, reason: str) -> None:
        """Keep nothing from now on, for ``reason``."""
        self.stopped = reason

    def closed(self, engine) -> None:
        """A call with grad: the rollout is over until the weights change."""
        self.closed_at = engine.reader.writes()
