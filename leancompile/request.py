"""What the caller of ``optimize`` or ``wrap`` asked for: one value, its arguments checked once for both entry
points, each bad one refused with the parameter's name and the fix."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .plan import AUTO, VALUES, VERIFY, Schedule

# What each entry point accepts as ``schedule``: every schedule, auto, and (optimize only) the native program
SCHEDULE_NAMES = (AUTO, *(str(s) for s in Schedule if s is not Schedule.NATIVE))
OPTIMIZE_SCHEDULES = (*SCHEDULE_NAMES, str(Schedule.NATIVE))
WRAP_SCHEDULES = SCHEDULE_NAMES
# Keyword arguments of diffusers transformers shared by every row whatever their length (position ids).
SHARED_ARGUMENTS = ("img_ids", "txt_ids")


@dataclass(frozen=True)
class Request:
    """What the caller asked for. ``entry``: ``"optimize"`` or ``"wrap"``, whose schedules it accepts."""

    schedule: str = AUTO
    entry: str = "optimize"
    memory_budget: float | None = None  # the fraction of the saved activations a Retain partition may keep
    strict: bool = False  # optimize: refuse reuse where the rollout's numerics differ from the update's
    memory_limit: int | None = None  # bytes: the auto planner's (optimize), the kept calls' (wrap)
    samples_per_step: int | None = None
    device: object = None  # the device the auto planner plans for
    per_block: bool | None = None  # how the runtime runs Retain and Reweight (see optimize and wrap)
    tune_matmuls: bool = True
    bitwise: bool = False
    shared: tuple[str, ...] = SHARED_ARGUMENTS  # wrap: keyword arguments every row shares
    trained: Callable[[int], bool] | None = None  # wrap: which of a rollout's calls the update trains
    raises: bool = False  # wrap's ``strict``: raise NothingServedError where NothingServedWarning would be given
    verify: str = VALUES  # what an answer is checked against besides the state: the weights' values or versions

    def __post_init__(self):
        names = OPTIMIZE_SCHEDULES if self.entry == "optimize" else WRAP_SCHEDULES
        if self.schedule not in names:
            raise ValueError(f"schedule must be one of {names}{' for a wrapped module' * (self.entry == 'wrap')}; "
                             f"got {self.schedule!r}")
        for field in fields(self):
            if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
                name = "strict" if field.name == "raises" else field.name
                raise ValueError(f"{name} must be True or False; got {getattr(self, field.name)!r}")
        if self.per_block is not None and not isinstance(self.per_block, bool):
            raise ValueError(f"per_block must be True, False or None; got {self.per_block!r}")
        if self.memory_budget is not None and not 0 <= self.memory_budget <= 1:
            raise ValueError(f"memory_budget must be a fraction in [0, 1] of the saved activations; got "
                             f"{self.memory_budget!r}")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit <= 0):
            raise ValueError(f"memory_limit must be a positive number of bytes; got {self.memory_limit!r}")
        if self.samples_per_step is not None and (not isinstance(self.samples_per_step, int)
                                                  or self.samples_per_step < 2):
            raise ValueError(f"samples_per_step must be an integer >= 2; got {self.samples_per_step!r}")
        if isinstance(self.shared, str) or not all(isinstance(name, str) for name in self.shared):
            raise ValueError(f"shared must be a tuple of keyword-argument names; got {self.shared!r}")
        if self.trained is not None and not callable(self.trained):
            raise ValueError(f"trained must be a callable trained(n) -> bool on a rollout's n-th call; got "
                             f"{self.trained!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY} ('versions' trusts that nothing writes the weights "
                             f"through .data or another alias); got {self.verify!r}")
        self._check_bitwise()

    def _check_bitwise(self) -> None:
        """``bitwise=True`` keeps the module's eager graph whole: Retain only, on the device, the whole call."""
        if not self.bitwise:
            return
        if self.entry == "wrap" and self.schedule not in (str(Schedule.RETAIN), AUTO):
            raise ValueError(f"bitwise=True keeps eager graphs on the device: it needs schedule='retain', got "
                             f"schedule={self.schedule!r}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"memory_budget={self.memory_budget!r} with bitwise=True: partial retention recomputes "
                             "part of the forward in the per-row program, which is not bitwise; drop one of them")
        if self.per_block:
            raise ValueError("per_block=True runs each block's compiled partition; it cannot serve bitwise=True "
                             "(which keeps the eager graph of the whole call): drop one of them")
