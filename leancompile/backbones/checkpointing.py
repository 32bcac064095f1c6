"""Activation checkpointing switched off for a while."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def without_checkpointing(module):
    """Retention is the opposite of activation checkpointing: compile the plain blocks (every submodule that has a
    ``gradient_checkpointing`` switch, as diffusers and transformers models do, has it off meanwhile)."""
    switches = [(m, m.gradient_checkpointing) for m in module.modules()
                if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    for m, _ in switches:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, old in switches:
            m.gradient_checkpointing = old
