"""Routing a trainer's backbone calls (``self.backbone(...)``) elsewhere for a while: to a copy on gathered weights,
to the reuse engine, or to a traced stand-in."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def running(trainer, backbone, attribute: str = "backbone"):
    """Every call of ``trainer``'s backbone (or of its module named ``attribute``) runs ``backbone`` for the
    duration."""
    original = getattr(trainer, attribute)
    trainer.__dict__[attribute] = backbone
    try:
        yield
    finally:
        trainer.__dict__[attribute] = original


class CalledAs:
    """Looks like ``backbone`` (attributes delegate to it) but a call runs ``call``."""

    def __init__(self, backbone, call):
        self._backbone = backbone
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backbone, name)


def calling(trainer, call):
    """Route the trainer's backbone calls to ``call`` for the duration."""
    return running(trainer, CalledAs(trainer.backbone, call))
