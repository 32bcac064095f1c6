"""Per-row weight gradients: let the backbone's backward graph also hand over each row's share of a weight's
gradient, at the cost of the ordinary backward.

A linear layer's weight gradient is one ``mm`` over all rows and tokens, ``G = D^T X`` with ``D`` and ``X`` of
``rows x tokens`` rows each (batch-major, as ``F.linear`` flattens them). Split that contraction by row and it
gives every row's own gradient: ``G_r = D_r^T X_r``, one ``bmm``. This pass finds, for each requested weight, the
``mm`` its gradient output comes from (through transposes), replaces it by the ``bmm`` and the sum of its rows, and
passes the ``bmm``'s result to :func:`deliver_per_row_gradient`; the graph's outputs are the same sums.

Before::

    %mm = aten.mm(%t_d, %x)                       # (o, rows * tokens) @ (rows * tokens, i)
    %t_1 = aten.t(%mm); %grad = aten.t(%t_1)      # output j

After::

    %per_row_d_j = aten.permute(aten.reshape(%t_d, (o, rows, tokens)), (1, 0, 2))
    %per_row_grad_j = aten.bmm(%per_row_d_j, aten.reshape(%x, (rows, tokens, i)))
    %sum_of_rows_j = aten.sum(%per_row_grad_j, [0])
    %t_1 = aten.t(%sum_of_rows_j); %grad = aten.t(%t_1)
    deliver_per_row_gradient(token, j, %per_row_grad_j)
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from .graph import op_name
from .meta import REWRITE

class PerRowGradients(dict):
    """Weight index -> the per-row gradient the last backward delivered."""


_SINKS: dict[int, weakref.ref] = {}  # token -> the PerRowGradients a rewritten graph delivers to


def deliver_per_row_gradient(token: int, index: int, gradient: torch.Tensor) -> None:
    _SINKS[token]()[index] = gradient


def register_sink(sink: PerRowGradients) -> int:
    """A token for graphs to deliver to ``sink``; the registry holds it weakly."""
    token = len(_SINKS)
    _SINKS[token] = weakref.ref(sink)
    return token


def split_weight_gradients_per_row(gm: fx.GraphModule, outputs: dict[int, int], rows: int, token: int) -> str | None:
    """Rewrite ``gm`` so that for each ``output position -> weight index`` in ``outputs`` the per-row gradient
    ``(rows, *weight.shape)`` is delivered to sink ``token``. Returns why not (and leaves ``gm`` alone), or None."""
    graph = gm.graph
    results = next(n for n in graph.nodes if n.op == "output").args[0]
    found = {}
    for position, index in outputs.items():
        node, transposes = results[position], 0
        while isinstance(node, fx.Node) and op_name(node) == "t.default":
            node, transposes = node.args[0], transposes + 1
        if not isinstance(node, fx.Node) or op_name(node) != "mm.default":
            return f"the gradient of weight {index} is not one matrix product ({getattr(node, 'name', node)})"
        left, right = node.args
        contraction = left.meta["val"].shape[1]
        if contraction % rows:
            return f"the gradient of weight {index} contracts {contraction} rows, not a multiple of {rows}"
        found[index] = (node, transposes, contraction // rows)
    aten = torch.ops.aten

    def insert(after: fx.Node, target, args: tuple) -> fx.Node:
        with graph.inserting_after(after):
            node = graph.call_function(target, args)
        node.meta[REWRITE] = "inserted"
        # Later passes read shapes and strides (the product-order pass times the bmm with them).
        node.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        return node

    for index, (mm, transposes, tokens) in found.items():
        left, right = mm.args
        o, i = left.meta["val"].shape[0], right.meta["val"].shape[1]
        d = insert(mm, aten.reshape.default, (left, [o, rows, tokens]))
        d = insert(d, aten.permute.default, (d, [1, 0, 2]))
        x = insert(d, aten.reshape.default, (right, [rows, tokens, i]))
        grad = insert(x, aten.bmm.default, (d, x))
        # The whole-batch product is the sum of the rows' products: one contraction instead of two.
        total = insert(grad, aten.sum.dim_IntList, (grad, [0]))
        mm.replace_all_uses_with(total)
        graph.erase_node(mm)
        total.name = f"sum_of_rows_{index}"
        last = insert(grad, aten.transpose.int, (grad, 1, 2)) if transposes % 2 else grad
        with graph.inserting_after(last):
            graph.call_function(deliver_per_row_gradient, (token, index, last))
        grad.name = f"per_row_grad_{index}"
    graph.lint()
    gm.recompile()
    return None
