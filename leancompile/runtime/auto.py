"""auto at run time: its floor, and the clock its trial (:mod:`.auto_trial`) reads.

The planner predicts; where its prediction is wrong (sizes at which fixed costs it models only roughly decide), the
runtime measures: whole cycles of the loop (a trainer's step under ``optimize``, rollout to rollout under ``wrap``)
run alternately natively and with the per-row program, and the program stays only where it measured faster.
"""
from __future__ import annotations

import time

import torch

# auto's floor: a loop under auto runs at least this fraction of native's speed (0: auto never falls back)
AUTO_FLOOR = 0.97


def now() -> float:
    """Seconds, once the device has finished what was queued."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
