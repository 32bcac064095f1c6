"""The wrapped module's class: the module's own with :class:`Wrapped` in front, as FSDP2's ``fully_shard`` puts
``FSDPModule`` in front. Its calls go to the runtime kept in the module's ``__dict__`` under :data:`RUNTIME`
(:mod:`.wrap_runtime`)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..backbones.plain import WRAPPED_CLASS

RUNTIME = "_leancompile_runtime"


class Wrapped(torch.nn.Module):
    """Put in front of the module's class by :func:`wrap`, as FSDP2's ``fully_shard`` puts ``FSDPModule``: the
    module stays itself (``isinstance``, ``state_dict()`` keys, ``save_pretrained``, peft's methods, a ``forward``
    assigned on it), and every call of it goes through the reuse engine."""

    def __call__(self, *args, **kwargs):
        """Run by the engine, never traced by dynamo (:func:`untraced`): ``torch.compile(module)`` wrapped before
        or after calls the module through here, and its calls are kept and served as the module's own (their
        native runs eager)."""
        return self.__dict__[RUNTIME](self, args, kwargs)

    def provisional(self, head: Callable[[float], torch.Tensor]) -> None:
        """``schedule="reweight"``: backpropagate the update's loss through the calls kept since the last time.

        ``head(advantage)`` computes the loss the update will compute for those calls' rows, at that one advantage
        for every row (it is called at 1 and 0), calling this module as the update does; those calls are answered
        with the kept outputs, nothing runs twice. Only each row's direction matters: a head off by a factor per
        row (another normalisation, the advantages' sign) still gives native's gradient, and one that is wrong
        otherwise makes the served calls recompute."""
        runtime = self.__dict__[RUNTIME].serving
        schedule = runtime.engine.schedule_runtime
        if not schedule.advantages:
            raise ValueError("provisional: the module was wrapped with schedule="
                             f"{runtime.policy.action.label!r}; wrap it with schedule='reweight'")
        if not callable(head):
            raise ValueError(f"head must be a callable head(advantage) -> loss; got {type(head).__name__}")
        runtime.engine.provisional([functools.partial(head, a) for a in schedule.advantages])

    def stats(self) -> dict:
        """Since the last call: calls with grad served (``served_calls``) and recomputed (with each recompute's
        reason by kind), calls without grad answered with kept values (``served_values``), the peak bytes the kept
        calls held, and the seconds the checks took; ``served_by``: the submodule that serves, where the module's
        own calls could not be kept."""
        return self.__dict__[RUNTIME].stats()

    @property
    def engine(self):
        """The reuse engine that serves this module's calls (a submodule's, after a descent)."""
        return self.__dict__[RUNTIME].serving.engine

    @property
    def pass_history(self):
        """Every pass run on the per-row program's graphs, in order (:mod:`leancompile.passes.pipeline`)."""
        return self.engine.rowwise[1.0].history

    @property
    def last_calls(self) -> list:
        """What the engine did with each call since ``stats()`` was last read."""
        runtime = self.__dict__[RUNTIME]
        return [*(note for each in runtime.chain() for note in each.notes), *runtime.serving.engine.log.records]

    def release(self) -> None:
        """Free every kept call now (they are freed anyway once the weights change)."""
        self.__dict__[RUNTIME].serving.engine.release()


_CLASSES: dict[type, type] = {}


@functools.cache
def untraced() -> None:
    """Keep dynamo out of :meth:`Wrapped.__call__`, at the first wrap: ``torch.compiler.disable`` imports
    torch._dynamo (most of a second), which ``import leancompile`` does not."""
    Wrapped.__call__ = torch.compiler.disable(Wrapped.__call__, recursive=True)


def wrapped_class(cls: type) -> type:
    """The module's class with :class:`Wrapped` in front, one per class (as FSDP2 makes ``FSDP<class>``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Wrapped{cls.__name__}", (Wrapped, cls), {"__module__": cls.__module__,
                                                                        WRAPPED_CLASS: True})
    return _CLASSES[cls]
