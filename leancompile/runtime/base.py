"""What every reuse runtime shares: the epoch-0 schedule drawn before the rollout, the log of what each update
micro-step did, and the reuse window (the micro-steps before the first optimizer step, at the rollout's weights).

A runtime is driven by the optimized trainer (:mod:`leancompile.optimized`) through the hooks below; the defaults
do nothing, so each runtime overrides only the call sites it rewrites.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class MicroStepRecord:
    epoch: int
    batch: int
    slot: int
    action: str  # "reuse" | "reweight" | "recompute"
    reason: str


@dataclass
class StepState:
    """Per-GRPO-step state every runtime keeps."""

    schedule: torch.Tensor | None = None  # epoch 0's trained steps (samples, k), drawn before the rollout
    versions: list[int] | None = None  # the trainable weights' version counters when the rollout used them
    window_open: bool = True  # no optimizer step yet since the rollout
    records: list[MicroStepRecord] = field(default_factory=list)
    epoch: int = 0
    batch: int = 0
    slot: int = 0
    batch_rows: object = None  # the micro-batch being trained, to count micro-batches and slots


class Runtime:
    """Base of the Retain and Reweight runtimes."""

    action = "reuse"  # what the runtime's log calls a micro-step it served
    state_class = StepState

    def __init__(self, trainable):
        self.trainable = trainable
        self.state = self.state_class()

    # ------------------------------------------------------------------------------------------ bookkeeping

    def begin_step(self) -> None:
        self.state = self.state_class()

    def end_step(self) -> dict:
        """Statistics of the step just run (merged into the trainer's)."""
        records = self.state.records
        return {"reused_micro_steps": sum(r.action == self.action for r in records),
                "recomputed_micro_steps": sum(r.action == "recompute" for r in records)}

    def trained_at(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """Which of ``rows`` train ``step`` in epoch 0 (bool per row)."""
        schedule = self.state.schedule
        if schedule is None:
            return torch.zeros(len(rows), dtype=torch.bool)
        return (schedule[rows.cpu()] == step).any(dim=1)

    def remember_weights(self) -> None:
        if self.state.versions is None:
            self.state.versions = [p._version for p in self.trainable]

    def window_refusal(self) -> str | None:
        """Why no micro-step can use the rollout's work now (None while it can)."""
        if not self.state.window_open:
            return "after an optimizer step: the weights differ from the rollout's"
        if self.state.versions is not None and [p._version for p in self.trainable] != self.state.versions:
            return "the trainable weights were modified since the rollout"
        return None

    def track_micro_step(self, rows) -> None:
        s = self.state
        if s.batch_rows is not rows:
            s.batch = s.batch + 1 if s.batch_rows is not None else 0
            s.batch_rows, s.slot = rows, 0
        else:
            s.slot += 1

    def next_epoch(self) -> None:
        self.state.epoch += 1
        self.state.batch_rows = None

    def record(self, action: str, reason: str) -> None:
        s = self.state
        s.records.append(MicroStepRecord(s.epoch, s.batch, s.slot, action, reason))

    # ------------------------------------------------------------------------------- hooks (default: none)

    def begin_rollout(self, trainer, prompts: list) -> None:
        pass

    def rollout_call(self, step: int, rows: torch.Tensor):
        """A callable replacing the backbone for the rollout's call ``(step, rows)``, or None."""
        return None

    def after_rollout_step(self, step, rows, x, x_next, log_prob, cond, loss_fn) -> None:
        pass

    def begin_update(self, rollout, advantages) -> None:
        pass

    def micro_step_loss(self, micro, loss_fn):
        return loss_fn(micro)

    def train_call(self, micro):
        """A callable replacing the backbone for the update's call in ``micro``, or None."""
        return None

    def reference_velocity(self, micro, compute):
        """The KL reference's velocity for ``micro`` (``compute(micro)``: the trainer's own call)."""
        return compute(micro)

    def after_backward(self) -> None:
        pass

    def before_optimizer_step(self, syncing) -> bool:
        """Add the rollout's work to the gradients, in a backward run under ``syncing`` (the context that completes
        the step's gradient across ranks); return whether such a backward ran."""
        self.state.window_open = False
        return False


@contextlib.contextmanager
def running(trainer, backbone):
    """Every backbone call of ``trainer`` runs ``backbone`` for the duration (a copy on gathered weights)."""
    original = trainer.backbone
    trainer.__dict__["backbone"] = backbone
    try:
        yield
    finally:
        trainer.__dict__["backbone"] = original


def swapped_backbone(trainer, call):
    """Route the trainer's backbone calls (``self.backbone(...)``) to ``call`` for the duration."""
    return running(trainer, _CallAs(trainer.backbone, call))


class _CallAs:
    """Looks like the backbone (attributes delegate to it) but calls ``call``."""

    def __init__(self, backbone, call):
        self._backbone = backbone
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backbone, name)
