"""The user's module as it was before the engine worked on it, put back where that work raised.

Tracing and compiling swap the module's tensors for functional or fake ones (``functional_call``, AOTAutograd)
and a block's engine routes its calls through a ``forward`` set on the block; an exception halfway leaves them
there, and every later call of the module, native ones included, would read them. A :class:`Snapshot` records each
submodule's class and instance ``__dict__`` (its parameters, buffers, submodules and hooks are dicts there) by
identity, one level deep, and :meth:`Snapshot.restore` puts those very objects back."""
from __future__ import annotations

import collections
import contextlib

import torch


class Snapshot:
    """Every submodule of ``module``: its class, its ``__dict__`` entries and the contents of those that are plain
    dicts, lists or sets (``_parameters``, ``_buffers``, ``_modules``, the hook dicts)."""

    def __init__(self, module: torch.nn.Module):
        self.modules = [(m, type(m), dict(m.__dict__), {k: _copied(v) for k, v in m.__dict__.items()
                                                         if type(v) in _CONTAINERS})
                        for m in module.modules()]

    def restore(self) -> None:
        for module, cls, attributes, contents in self.modules:
            for name, content in contents.items():
                _refill(attributes[name], content)
            if type(module) is not cls:
                module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update(attributes)


# Plain containers only: a subclass may refuse to be written (diffusers' FrozenDict config)
_CONTAINERS = (dict, collections.OrderedDict, list, set)


def _copied(container) -> list:
    return list(container.items() if isinstance(container, dict) else container)


def _refill(container, content: list) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(content)
    else:
        container.update(content)


@contextlib.contextmanager
def restored_on_failure(*modules: torch.nn.Module):
    """Inside, whatever raises leaves ``modules`` as they were on entry."""
    snapshots = [Snapshot(m) for m in modules]
    try:
        yield
    except BaseException:
        for snapshot in snapshots:
            snapshot.restore()
        raise
