"""Operations that return their input: drop them from the partitioned graphs.

Multiplications by one. peft scales every LoRA output by ``lora_alpha / r``, which is 1 at the usual
``lora_alpha = r``; the traced forward multiplies each LoRA layer's output by 1.0 and the backward its cotangent,
a pass over a whole activation each. ``x * 1.0`` is ``x`` exactly in IEEE arithmetic, so where the product has
``x``'s dtype, shape and strides (no promotion, broadcast or change of layout) and is not itself a graph output
(which would then alias ``x``), its users read ``x``::

    %mul = aten.mul.Tensor(%view_3, 1.0); %add = aten.add.Tensor(%addmm, %mul)
    ->  %add = aten.add.Tensor(%addmm, %view_3)

Copies of values nothing else reads. Dropout at ``p = 0`` in training mode (diffusers' attention and feed-forward
blocks) is traced as ``clone``: a pass over a whole activation (Wan's feed-forward hidden state, 4x the model
width) whose source no other node reads. Where the copy has the source's dtype, shape and strides and the source is
an intermediate (not an input, not a view of one) with no other reader, the copy's users read the source: nothing
can observe that the two were one tensor::

    %gelu = aten.gelu(%add, approximate="tanh"); %clone = aten.clone(%gelu); %view = aten.view(%clone, ...)
    ->  %gelu = aten.gelu(%add, approximate="tanh"); %view = aten.view(%gelu, ...)
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _same_tensor(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def _bypass(gm: torch.fx.GraphModule, returned_input) -> int:
    """Remove every node for which ``returned_input(node)`` names the input it returns unchanged; its users read
    that input. Returns how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        source = returned_input(node)
        if source is None:
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def _multiplied_by_one(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.target not in (aten.mul.Tensor, aten.mul.Scalar) or node.kwargs:
        return None
    x, factor = node.args
    if isinstance(factor, torch.fx.Node):
        x, factor = factor, x
    if (not isinstance(x, torch.fx.Node) or isinstance(factor, torch.fx.Node) or isinstance(factor, bool)
            or factor != 1 or any(user.op == "output" for user in node.users)
            or not _same_tensor(x.meta.get("val"), node.meta.get("val"))):
        return None
    return x


def drop_multiplications_by_one(gm: torch.fx.GraphModule) -> int:
    """Remove the ``mul(x, 1)`` nodes of ``gm`` that return ``x`` unchanged; returns how many."""
    return _bypass(gm, _multiplied_by_one)


def _returns_fresh_tensor(node: torch.fx.Node) -> bool:
    """An operator whose schema aliases none of its arguments (no view, no in-place write)."""
    return (isinstance(node.target, torch._ops.OpOverload)
            and all(a.alias_info is None for a in node.target._schema.arguments))


def _unshared_copy(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.target is not aten.clone.default:
        return None
    source = node.args[0]
    if (not isinstance(source, torch.fx.Node) or source.op != "call_function" or len(source.users) != 1
            or not _returns_fresh_tensor(source) or not _same_tensor(source.meta.get("val"), node.meta.get("val"))):
        return None
    return source


def drop_copies_of_unshared_values(gm: torch.fx.GraphModule) -> int:
    """Remove the ``clone`` nodes of ``gm`` whose source only the clone reads and whose layout the clone keeps;
    returns how many."""
    return _bypass(gm, _unshared_copy)
