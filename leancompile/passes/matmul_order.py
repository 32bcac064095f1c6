"""Matrix products in the operand order the device runs fastest.

``A @ B`` equals ``(B^T @ A^T)^T``, but BLAS libraries are not equally fast at both. On a CPU the weight gradient
of a LoRA matrix, ``grad^T @ h`` with ``grad`` (tokens x 1024, read transposed) and ``h`` (tokens x 4), runs about
ten times slower as autograd writes it than as ``(h^T @ grad)^T``; eager PyTorch always runs the first. This pass
times both orders of every distinct ``mm`` / ``bmm`` of a graph (shapes, strides, dtype, device) on the device the
graph runs on, once per process, and rewrites the products whose other order is faster by more than ``margin``.
The result is copied back into the layout the product had, so no later operator sees another layout::

    %mm = aten.mm(%t_d, %h)                          # %t_d = aten.t(%d)
    ->  %swapped_mm = aten.mm(aten.t(%h), %d)
        %mm = aten.clone(aten.t(%swapped_mm), memory_format=torch.contiguous_format)

Each product timed carries its :class:`ProductTiming` in ``node.meta[MATMUL_ORDER]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .meta import MATMUL_ORDER, REWRITE, Rewrite

aten = torch.ops.aten
# per product: the op and the extra arguments that transpose its operands' last two dims
_TRANSPOSE = {aten.mm.default: (aten.t.default, ()), aten.bmm.default: (aten.transpose.int, (1, 2))}


@dataclass(frozen=True)
class ProductTiming:
    """Seconds per call of a product as written and with its operands swapped (and the result copied back)."""

    written: float
    swapped: float

    def swap(self, margin: float) -> bool:
        return self.swapped * (1 + margin) < self.written


_TIMINGS: dict[tuple, ProductTiming] = {}  # signature -> timing, for the life of the process


def _signature(node: torch.fx.Node) -> tuple:
    a, b = (arg.meta["val"] for arg in node.args)
    return (node.target, a.dtype, a.device.type, a.device.index, tuple(a.shape), a.stride(), tuple(b.shape),
            b.stride())


def _random_like(v: torch.Tensor) -> torch.Tensor:
    """Random values with ``v``'s shape and strides (also an expanded one: stride 0 shares elements), drawn from a
    generator of their own: timing must not move the random stream of the loop that compiles (its sampling)."""
    size = 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride()) if n > 0)
    generator = torch.Generator(device=v.device).manual_seed(0)
    return torch.randn(size, dtype=v.dtype, device=v.device, generator=generator).as_strided(v.shape, v.stride())


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _seconds(fn, device: torch.device) -> float:
    """The fastest of a few timed runs (after a warm-up), each long enough to read off a CPU clock."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        synchronize()
        while True:
            fn()
            calls += 1
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed > 2e-3 or calls >= 50:
                break
        best = min(best, elapsed / calls)
    return best


def time_product(node: torch.fx.Node) -> ProductTiming:
    """Time ``node`` (an ``mm`` or ``bmm``) both ways on random operands of its shapes and strides."""
    key = _signature(node)
    if key not in _TIMINGS:
        # A FLOP counter or memory tracker the caller runs is not to see the trials; the graph's dtypes are explicit
        # (a compilation under autocast has already cast), so autocast is off for them.
        device = node.args[0].meta["val"].device.type
        with _disable_current_modes(), torch.autocast(device, enabled=False), torch.no_grad():
            _TIMINGS[key] = _time_both_orders(node)
    return _TIMINGS[key]


def _time_both_orders(node: torch.fx.Node) -> ProductTiming:
    op = node.target
    a, b = (_random_like(arg.meta["val"]) for arg in node.args)
    written = _seconds(lambda: op(a, b), a.device)
    swapped = _seconds(lambda: _transposed(op(_transposed(b), _transposed(a))).contiguous(), a.device)
    return ProductTiming(written, swapped)


def _transpose_of(graph: torch.fx.Graph, x: torch.fx.Node, op) -> torch.fx.Node:
    """A node for ``x`` transposed in its last two dims: ``x``'s own input where ``x`` is that transpose."""
    transpose, dims = _TRANSPOSE[op]
    if x.op == "call_function" and x.target is transpose and tuple(x.args[1:]) == dims:
        return x.args[0]
    return graph.call_function(transpose, (x, *dims))


def order_matrix_products(gm: torch.fx.GraphModule, margin: float = 0.1, timer=time_product) -> int:
    """Swap the operands of the products of ``gm`` that run faster so on their device (``timer(node)`` gives a
    node's :class:`ProductTiming`); returns how many. Every node keeps its name."""
    graph, swapped = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TRANSPOSE or node.kwargs:
            continue
        if not all(isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
                   for arg in node.args):
            continue
        timing = node.meta[MATMUL_ORDER] = timer(node)
        if not timing.swap(margin):
            continue
        a, b = node.args
        name, transpose, dims = node.name, *_TRANSPOSE[node.target]
        with graph.inserting_before(node):
            product = graph.call_function(node.target, (_transpose_of(graph, b, node.target),
                                                        _transpose_of(graph, a, node.target)))
            back = graph.call_function(transpose, (product, *dims))
            result = graph.call_function(aten.clone.default, (back,), {"memory_format": torch.contiguous_format})
        product.name = f"swapped_{name}"
        for new in (product, back, result):
            new.meta[REWRITE] = Rewrite.REORDERED
        product.meta[MATMUL_ORDER] = timing
        result.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        result.name = name  # the graph's names (e.g. per_row_grad_3) stay what other passes gave them
        for operand in (a, b):  # a transpose only the product read
            if not operand.users and operand.target is transpose:
                graph.erase_node(operand)
        swapped += 1
    return swapped
