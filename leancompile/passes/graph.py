"""Small queries over FX nodes shared by the passes and the report."""
from __future__ import annotations

import torch
import torch.fx as fx


def op_name(node: fx.Node) -> str:
    """``"mul.Tensor"`` for an aten overload, the function's name otherwise."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.overloadpacket.__name__}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def op_packet(node: fx.Node) -> str:
    """The op without its overload: ``"mul"`` for ``aten.mul.Tensor``."""
    return op_name(node).split(".")[0]


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def reading_data(graph: fx.Graph, weights: int) -> set[fx.Node]:
    """The nodes of a partition's forward ``graph`` that read a data input (the placeholders after the first
    ``weights``): the rest is computed from the weights alone."""
    reads = set(list(graph.find_nodes(op="placeholder"))[weights:])
    for node in graph.nodes:
        if node.op == "call_function" and any(a in reads for a in node.all_input_nodes):
            reads.add(node)
    return reads
