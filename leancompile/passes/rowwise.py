"""Make a batch-1 partition graph safe to map over rows with ``torch.vmap``.

The per-row backbone (:mod:`leancompile.runtime.rowwise`) traces ``vmap`` of the batch-1 forward and backward
graphs into graphs over ``B`` rows. Two kinds of aten node trace at batch 1 but not under ``vmap``:

* ``view`` / ``_unsafe_view``: a view is legal on the batch-1 tensor's strides, but under ``vmap`` the row dimension
  sits in front of them and the same view can span two strided subspaces. In a functional graph ``reshape``
  computes the same values (copying where it must)::

      %view_3 = aten.view(%mm, [1, 64, 256])  ->  %view_3 = aten.reshape(%mm, [1, 64, 256])

* ``slice`` / ``slice_scatter`` whose end is ``sys.maxsize`` (``x[..., 0::2]``): the batching rule overflows on it.
  The end becomes the sliced dimension's size, the same slice::

      %slice_9 = aten.slice(%view_6, 3, 0, 9223372036854775807, 2)  ->  aten.slice(%view_6, 3, 0, 32, 2)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .meta import REWRITE

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_SLICES = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}  # op -> position of its ``dim`` argument


@dataclass(frozen=True)
class RowwiseResult:
    """What :func:`prepare_for_rows` changed."""

    reshapes: int  # views that became reshapes
    clamped_slices: int  # slice ends set to the dimension's size

    @property
    def modified(self) -> bool:
        return bool(self.reshapes or self.clamped_slices)


def prepare_for_rows(gm: fx.GraphModule) -> RowwiseResult:
    """Rewrite ``gm`` (in place) so that ``vmap`` over a leading row dimension traces it."""
    reshapes = clamped = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _VIEWS:
            node.target = aten.reshape.default
            node.meta[REWRITE] = "reshape"
            reshapes += 1
        elif node.target in _SLICES:
            clamped += _clamp_slice_end(node)
    if reshapes or clamped:
        gm.graph.lint()
        gm.recompile()
    return RowwiseResult(reshapes, clamped)


def _clamp_slice_end(node: fx.Node) -> int:
    """``slice(x, dim, start, end, step)`` (``slice_scatter(x, src, dim, start, end, step)``): end := size."""
    first = _SLICES[node.target]
    args = list(node.args)
    if len(args) < first + 3 or args[first + 2] is None:
        return 0
    dim = args[first]
    size = node.args[0].meta["val"].shape[dim]
    if args[first + 2] <= size:
        return 0
    args[first + 2] = size
    node.args = tuple(args)
    node.meta[REWRITE] = "clamped"
    return 1


def random_operators(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that draw random numbers (dropout with ``p > 0``, ``rand*``, ``bernoulli``): a call
    that runs one cannot be reused, its rerun would draw other numbers. Operators tagged as seeded that take a
    dropout probability (attention kernels, ``native_dropout``) draw nothing at ``p = 0`` or outside training."""
    seeded = torch.Tag.nondeterministic_seeded
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if seeded not in node.target.tags:
            continue
        arguments = {a.name: a.default_value for a in node.target._schema.arguments}
        arguments.update(zip((a.name for a in node.target._schema.arguments), node.args))
        arguments.update(node.kwargs)
        probability = arguments.get("dropout_p", arguments.get("p"))
        if probability is not None and (probability == 0 or arguments.get("train") is False):
            continue
        found.append(node.name)
    return found
