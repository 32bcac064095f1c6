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

Views of views. ``vmap`` traces each batched operator with the views that move the row dimension in and out, so
the per-row programs' traced graphs are a third views (the LLM's 32-row backward: 370 of 1087 nodes), and each
costs a Python call at run time. A view, reshape, expand or squeeze to its input's own shape, an identity
permutation and a detach are their input; permutations of permutations compose; and a reshape of a reshape that
nothing else reads reshapes the first one's input (in graphs without in-place writes)::

    %view_7 = aten.view(%mm_3, [32, 8, 256]); %view_8 = aten._unsafe_view(%view_7, [256, 256])
    ->  %view_8 = aten.reshape(%mm_3, [256, 256])
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


_SAME_SHAPE = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
               aten.squeeze.dims)
_ALIASES = (aten.detach.default, aten.alias.default)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)


def _permutation(node: torch.fx.Node) -> list[int]:
    """The dimension order a ``permute``, ``transpose`` or ``t`` node's result reads from its input."""
    rank = node.meta["val"].dim()
    if node.target is aten.permute.default:
        return [d % rank for d in node.args[1]]
    order = list(range(rank))
    if rank >= 2:
        a, b = (node.args[1] % rank, node.args[2] % rank) if node.target is aten.transpose.int else (0, 1)
        order[a], order[b] = order[b], order[a]
    return order


def _unchanged_view(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of a view that returns it as it is, whatever its strides: a view, reshape, expand or squeeze to
    its own shape, an identity permutation, a detach (the traced values' shapes are exact; their strides are a
    meta kernel's guess, so they are not relied on)."""
    if node.op != "call_function" or not isinstance(source := node.args[0], torch.fx.Node):
        return None
    old, new = source.meta.get("val"), node.meta.get("val")
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return None
    if node.target in _SAME_SHAPE:
        unchanged = old.shape == new.shape
    elif node.target in _PERMUTES:
        unchanged = _permutation(node) == list(range(new.dim()))
    else:
        unchanged = node.target in _ALIASES
    # A graph output may become its source only where nothing else can hold that tensor (a fresh value read here
    # alone), so that no two outputs, or an output and an input, become one tensor.
    if not unchanged or (any(u.op == "output" for u in node.users) and not (
            source.op == "call_function" and len(source.users) == 1 and _returns_fresh_tensor(source))):
        return None
    return source


def _mutates(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def fold_views(gm: torch.fx.GraphModule) -> int:
    """Remove the views of ``gm`` that return their input as it is (and nodes nothing reads), compose
    permutations, and reshape the input of a reshape chain directly; returns how many nodes went."""
    before = len(gm.graph.nodes)
    for node in list(gm.graph.nodes):  # a permutation of a permutation is one permutation
        source = node.args[0] if node.op == "call_function" and node.target in _PERMUTES else None
        if (isinstance(source, torch.fx.Node) and source.target in _PERMUTES and len(source.users) == 1
                and "val" in source.meta and "val" in node.meta):
            inner, outer = _permutation(source), _permutation(node)
            node.args, node.target = (source.args[0], [inner[i] for i in outer]), aten.permute.default
            gm.graph.erase_node(source)
    _bypass(gm, _unchanged_view)
    # reshape(reshape(x, a), b) is reshape(x, b) in values; which of them copies may differ, so not where the
    # graph writes in place (an in-place write must reach the tensors it reached before).
    if not any(_mutates(n) for n in gm.graph.nodes):
        for node in list(gm.graph.nodes):
            source = node.args[0] if node.op == "call_function" and node.target in _RESHAPES else None
            if (isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target in _RESHAPES
                    and len(source.users) == 1):
                node.args, node.target = (source.args[0], node.args[1]), aten.reshape.default
                gm.graph.erase_node(source)
    gm.graph.eliminate_dead_code()
    return before - len(gm.graph.nodes)
