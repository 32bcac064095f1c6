"""Gradient-need pruning: which rows of the shared backbone call does the update's loss differentiate?

A row segment of the call's output (e.g. the unconditional half of a CFG batch) whose every path to the loss
passes through ``detach`` needs no backward, so the rollout need not keep its activations. Writes
``node.meta[NEEDS_GRAD]`` on the call's output node: the tuple of segments that need gradient.

Before: ``out = backbone([uncond, cond]); u, c = out.chunk(2); v = u.detach() + g * (c - u.detach())``
After:  ``out.meta[NEEDS_GRAD] == (1,)`` -- only the conditional half is retained.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .shared import backbone_calls, call_boundary
from .graph import op_name
from .meta import NEEDS_GRAD

# Ops through which no gradient flows.
_NON_DIFFERENTIABLE = {"detach.default", "ge.Scalar", "gt.Scalar", "le.Scalar", "lt.Scalar", "eq.Scalar",
                       "ge.Tensor", "gt.Tensor", "le.Tensor", "lt.Tensor", "eq.Tensor", "ne.Scalar", "argmax.default",
                       "sign.default"}
_SPLITS = {"split.Tensor", "chunk.default", "split_with_sizes.default"}


@dataclass(frozen=True)
class GradientNeed:
    """The segments of the shared call's batch that the loss differentiates, and those it does not."""

    needed: tuple[int, ...]
    pruned: tuple[int, ...]


def _reaches_loss(node: fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            if user.op == "call_function" and op_name(user) in _NON_DIFFERENTIABLE:
                continue
            stack.append(user)
    return False


def prune_gradient_need(update: fx.GraphModule, call_index: int, segments: int) -> GradientNeed:
    """Mark which of the ``segments`` of update call ``call_index``'s output reach the loss differentiably."""
    _, outputs = call_boundary(backbone_calls(update)[call_index])
    needed = set()
    for out in outputs:
        splits = [u for u in out.users if u.op == "call_function" and op_name(u) in _SPLITS
                  and (len(u.args) < 3 or u.args[2] == 0)]
        if segments > 1 and splits and len(out.users) == len(splits):
            for split in splits:
                for getitem in split.users:
                    if _reaches_loss(getitem):
                        needed.add(int(getitem.args[1]))
        elif _reaches_loss(out):
            needed.update(range(segments))
        out.meta[NEEDS_GRAD] = tuple(sorted(needed))
    return GradientNeed(tuple(sorted(needed)), tuple(s for s in range(segments) if s not in needed))
