"""What a schedule adds to the engines: its hooks. Everything that differs between Retain, Reweight and bitwise
Retain at run time is one of these methods, so that the engines (:mod:`.engine`, :mod:`.regional`) never ask which
schedule they run."""
from __future__ import annotations

import torch

from ..plan import StepAction
from .calls import Call
from .store import Found, KeptCall, Match


class ScheduleRuntime:
    """What a schedule (Retain, Reweight) adds to the engine: what it keeps per row and how a served call's
    backward turns the call's cotangent into parameter gradients."""

    name = "schedule"
    held = "retained_bytes"  # the statistic that reports the peak bytes it keeps (one of engine.HELD)
    input_gradients = False  # whether a served call's inputs may require grad (their gradients are returned too)
    # The provisional advantages its loss heads run at, right after a kept call (none: it runs no heads)
    advantages: tuple[float, ...] = ()

    def keep(self, engine, kept: KeptCall, saved: list[torch.Tensor], action: StepAction) -> None:
        raise NotImplementedError

    def refusal(self, engine, key: tuple, call: Call) -> str | None:
        """Why this schedule cannot keep calls of compile key ``key`` (None: it can); asked before each keep."""
        return None

    def forward(self, engine, rowwise, key: tuple, call: Call) -> tuple:
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

    def gradients(self, engine, match: Match, cotangent: torch.Tensor, inputs: tuple[int, ...] = (),
                  context=None) -> list[torch.Tensor] | None:
        """The trainable parameters' gradients for the served rows, then those of the call's tensors at positions
        ``inputs`` (None: not verified, recompute them); ``context``: what verified the call (a block's: the
        backbone call's, see :meth:`block_context`)."""
        raise NotImplementedError

    def provisional(self, engine, calls: list[KeptCall], heads: list) -> None:
        """Backpropagate the loss ``heads`` through the kept ``calls`` (schedules with :attr:`advantages`)."""
        raise ValueError(f"provisional loss heads need schedule='reweight'; this engine runs {self.name}")

    # ------------------------------------------------------------------------------ per transformer block

    def for_block(self) -> "ScheduleRuntime | None":
        """A runtime with this one's settings for one transformer block's engine, whose served calls return their
        inputs' gradients too (see runtime.regional); None where this schedule cannot serve a block."""
        return None

    def block_context(self, found: Found, precision: torch.dtype | None) -> tuple[object, str | None]:
        """For a verified backbone call with grad run per block: what its blocks' served calls are handed with
        their cotangents, or why the call cannot be served (the blocks then recompute)."""
        return None, None

    def blocks_kept(self, action: StepAction, sizes: list[int]) -> tuple[range, StepAction]:
        """Which blocks (their trainable parameters' ``sizes``) keep a call the plan keeps under ``action``, and
        the action each keeps it under: every block, at the action's activation budget."""
        return range(len(sizes)), action
