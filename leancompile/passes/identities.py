"""Multiplications by one: drop them from the partitioned graphs.

peft scales every LoRA output by ``lora_alpha / r``, which is 1 at the usual ``lora_alpha = r``; the traced
forward multiplies each LoRA layer's output by 1.0 and the backward its cotangent, a pass over a whole activation
each. ``x * 1.0`` is ``x`` exactly in IEEE arithmetic, so where the product has ``x``'s dtype, shape and strides
(no promotion, broadcast or change of layout) and is not itself a graph output (which would then alias ``x``),
its users read ``x``::

    %mul = aten.mul.Tensor(%view_3, 1.0); %add = aten.add.Tensor(%addmm, %mul)
    ->  %add = aten.add.Tensor(%addmm, %view_3)
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _same_tensor(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def drop_multiplications_by_one(gm: torch.fx.GraphModule) -> int:
    """Remove the ``mul(x, 1)`` nodes of ``gm`` that return ``x`` unchanged; returns how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.target not in (aten.mul.Tensor, aten.mul.Scalar) or node.kwargs:
            continue
        x, factor = node.args
        if isinstance(factor, torch.fx.Node):
            x, factor = factor, x
        if (not isinstance(x, torch.fx.Node) or isinstance(factor, torch.fx.Node) or isinstance(factor, bool)
                or factor != 1 or any(user.op == "output" for user in node.users)
                or not _same_tensor(x.meta.get("val"), node.meta.get("val"))):
            continue
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped
