"""Running a trainer's step on another backbone object (a copy on gathered weights, or the engine's router)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def running(trainer, backbone):
    """Every backbone call of ``trainer`` (``self.backbone(...)``) runs ``backbone`` for the duration."""
    original = trainer.backbone
    trainer.__dict__["backbone"] = backbone
    try:
        yield
    finally:
        trainer.__dict__["backbone"] = original
