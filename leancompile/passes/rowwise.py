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

import operator

import torch
import torch.fx as fx

from torch.utils import _pytree as pytree

from .meta import FACTORED, FACTORS, REWRITE, ROWS, Rewrite

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_SLICES = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}  # op -> position of its ``dim`` argument


def prepare_for_rows(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (in place) so that ``vmap`` over a leading row dimension traces it; returns the views made
    reshapes and the slice ends clamped."""
    reshapes = clamped = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _VIEWS:
            node.target = aten.reshape.default
            node.meta[REWRITE] = Rewrite.RESHAPE
            reshapes += 1
        elif node.target in _SLICES:
            clamped += _clamp_slice_end(node)
    return reshapes + clamped


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
    node.meta[REWRITE] = Rewrite.CLAMPED
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


# Operators that compute each index of dimension 0 of their tensors on its own (attention kernels: dimension 0 is
# the batch) and that ``vmap`` has no batching rule for: it traces them once per row.
_BATCH_FIRST = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def fold_per_row_calls(gm: fx.GraphModule) -> int:
    """Fold the per-row calls ``vmap`` leaves of a batch-first operator into one call over all rows.

    Without a batching rule, ``vmap`` traces such an operator once per row, on ``select(X, 0, i)`` of each input
    (whose row has the one-row program's batch dimension of 1 first), and stacks the rows' results::

        %q_0 = select(%q, 0, 0) ... %out_0 = sdpa(%q_0, %k_0, %v_0); ...; %o = stack([%out_0[0], %out_1[0], ...])

    The operator computes each index of dimension 0 on its own, so one call on every row at once
    (``reshape(%q, [R, ...])``) computes the same values; its results, viewed back with their row dimension,
    replace the per-row ones (a ``stack`` of all of them in order becomes that view)::

        %all = sdpa(reshape(%q, [R, ...]), ...); %o = reshape(%all[0], [R, 1, ...])
    """
    groups: dict[tuple, list[tuple[int, fx.Node]]] = {}  # (operator, inputs but the row) -> (row, call) ...
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BATCH_FIRST:
            sources = _row_sources(node)
            if sources is not None:
                groups.setdefault((node.target, sources[1]), []).append((sources[0], node))
    folded = calls = 0
    for (_, pattern), rows in groups.items():
        rows.sort(key=lambda r: r[0])
        total = next(source.meta["val"].shape[0] for kind, source in pattern if kind == "row")
        if [i for i, _ in rows] != list(range(total)) or total < 2:  # every row once, or nothing to fold
            continue
        _fold(gm, [n for _, n in rows], total)
        folded += 1
        calls += total
    if folded:
        _stacks_of_rows_to_views(gm)
        gm.graph.eliminate_dead_code()
    return calls


def _row_sources(node: fx.Node):
    """``(row, inputs)`` of a per-row call: each tensor input is ``select(X, 0, row)`` of an input ``X`` whose rows
    have a leading 1 (``("row", X)``), or the same for every row (``("same", input)``). None if it is not such a
    call."""
    row, pattern = None, []
    for arg in [*node.args, *node.kwargs.values()]:
        if isinstance(arg, fx.Node) and arg.target is aten.select.int and arg.args[1] == 0:
            source = arg.args[0]
            shape = source.meta["val"].shape
            if len(shape) < 2 or shape[1] != 1 or (row is not None and arg.args[2] != row):
                return None
            row = arg.args[2]
            pattern.append(("row", source))
        else:
            pattern.append(("same", arg))
    return (row, tuple(pattern)) if row is not None else None


def _fold(gm: fx.GraphModule, nodes: list[fx.Node], rows: int) -> None:
    first, graph = nodes[0], gm.graph

    def whole(arg):
        if isinstance(arg, fx.Node) and arg.target is aten.select.int and arg.args[1] == 0:
            shape = arg.args[0].meta["val"].shape
            return graph.call_function(aten.reshape.default, (arg.args[0], [rows * shape[1], *shape[2:]]))
        return arg

    with graph.inserting_before(first):
        call = graph.call_function(first.target, tuple(whole(a) for a in first.args),
                                   {k: whole(v) for k, v in first.kwargs.items()})
        call.meta.update({REWRITE: Rewrite.FOLDED, ROWS: rows})
        per_row = {}  # result index -> the result viewed with its row dimension
        for row, node in enumerate(nodes):
            for user in list(node.users):
                index = user.args[1]
                if index not in per_row:
                    result = graph.call_function(operator.getitem, (call, index))
                    per_row[index] = graph.call_function(aten.reshape.default,
                                                         (result, [rows, *user.meta["val"].shape]))
                user.replace_all_uses_with(graph.call_function(aten.select.int, (per_row[index], 0, row)))
                graph.erase_node(user)
    for node in nodes:
        graph.erase_node(node)


def _stacks_of_rows_to_views(gm: fx.GraphModule) -> None:
    """``stack([select(Y, 0, 0), ..., select(Y, 0, R-1)], 0)`` is ``Y``."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.stack.default or (len(node.args) > 1 and node.args[1] != 0):
            continue
        items = node.args[0]
        source = items[0].args[0] if items and items[0].target is aten.select.int else None
        if source is not None and source.target is aten.reshape.default and source.args[1][0] == len(items) and all(
                x.target is aten.select.int and x.args[:3] == (source, 0, i) for i, x in enumerate(items)):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)


def sum_products_over_rows(gm: fx.GraphModule) -> int:
    """Rewrite each sum over the rows of a batched matrix product into one product over all rows at once.

    A weight's gradient summed over ``R`` rows comes out of ``vmap`` as ``R`` small products and a sum, behind the
    views that lay the product out as the weight::

        %p = bmm(%a, %b)  # (R, m, k) @ (R, k, n)
        %g = sum(transpose(_unsafe_view(%p, [R, m, n]), 1, 2), [0])

    ``sum_r a_r @ b_r`` is ``[a_0 ... a_R-1] @ [b_0; ...; b_R-1]``, one product over ``R * k``; the views act on the
    dimensions after the rows, so they apply to that product with the row dimension dropped::

        %p = mm(reshape(permute(%a, [1, 0, 2]), [m, R * k]), reshape(%b, [R * k, n]))
        %g = transpose(reshape(%p, [m, n]), 0, 1)
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.sum.dim_IntList and list(node.args[1]) == [0] and not _keepdim(node):
            count += _sum_of_product(gm.graph, node)
    if count:
        gm.graph.eliminate_dead_code()
    return count


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


_ROW_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _sum_of_product(graph: fx.Graph, total: fx.Node) -> int:
    """Rewrite ``total`` (a sum over dimension 0) where it sums a batched product through row-preserving views."""
    chain, node = [], total.args[0]
    while node.op == "call_function" and node.target is not aten.bmm.default:
        rows = node.meta["val"].shape[0] if "val" in node.meta else None
        if len(node.users) != 1 or rows is None:
            return 0
        if node.target in _ROW_VIEWS and node.args[0].meta["val"].shape[0] == rows == node.args[1][0]:
            chain.append(node)
        elif node.target is aten.transpose.int and min(node.args[1], node.args[2]) > 0:
            chain.append(node)
        else:
            return 0
        node = node.args[0]
    if node.target is not aten.bmm.default or len(node.users) != 1:
        return 0
    a, b = node.args
    rows, m, k = a.meta["val"].shape
    n = b.meta["val"].shape[2]
    if rows < 2:  # one product already: the rewrite would only copy ``a``
        return 0
    with graph.inserting_before(total):
        left = graph.call_function(aten.reshape.default,
                                   (graph.call_function(aten.permute.default, (a, [1, 0, 2])), [m, rows * k]))
        right = graph.call_function(aten.reshape.default, (b, [rows * k, n]))
        value = graph.call_function(aten.mm.default, (left, right))
        for op in reversed(chain):
            if op.target is aten.transpose.int:
                value = graph.call_function(aten.transpose.int, (value, op.args[1] - 1, op.args[2] - 1))
            else:
                value = graph.call_function(aten.reshape.default, (value, list(op.args[1][1:])))
    value.meta.update({REWRITE: Rewrite.SUMMED, ROWS: rows})
    total.replace_all_uses_with(value)
    graph.erase_node(total)
    return 1


def keep_products_as_factors(gm: fx.GraphModule) -> int:
    """Return each per-row weight gradient that is a product of two smaller factors as the pair of factors.

    Reweight keeps every row's gradient of every trainable weight until an update call combines them with its
    coefficients (:mod:`leancompile.runtime.reweight`). A linear layer's per-row gradient is a product ``a_r @ b_r``
    over the row's tokens, ``(R, m, k) @ (R, k, n)``; where its factors hold fewer values than it, ``k (m + n) < m
    n`` (a one-token linear such as the adaLN modulation, ``k = 1``), the graph returns the factors instead: the
    rollout skips the product and writes ``k (m + n)`` values a row, not ``m n``, and the combination ``sum_r w_r
    a_r @ b_r`` is one product over ``R k`` (the update's own weight gradient)::

        %g = bmm(%a, %b)                  ->  output [..., (%a, %b), ...]
        %g = unsqueeze(mm(%a, %b), 0)     ->  output [..., (unsqueeze(%a, 0), unsqueeze(%b, 0)), ...]   (one row)

    Only the leading outputs the output node's ``FACTORS`` counts are considered (set where the caller combines
    factors); ``FACTORED`` records the positions returned so."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    count = output.meta.get(FACTORS, 0)
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if not count or info is None or info.out_spec is None:
        return 0
    results = pytree.tree_unflatten(list(output.args[0]), info.out_spec)
    factored = []
    for i, node in enumerate(results[:count]):
        factors = _factors(gm.graph, node)
        if factors is not None:
            results[i] = factors
            factored.append(i)
    if not factored:
        return 0
    leaves, spec = pytree.tree_flatten(results)
    output.args = (leaves,)
    codegen.pytree_info = info._replace(out_spec=spec)
    output.meta[FACTORED] = tuple(factored)
    gm.graph.eliminate_dead_code()
    return len(factored)


def _factors(graph: fx.Graph, node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` where ``node`` is the per-row product ``bmm(a, b)`` (or ``unsqueeze(mm(a, b), 0)``), behind views
    that keep its shape, whose factors hold fewer values than it; else None."""
    node = _unviewed(node)
    one_row = isinstance(node, fx.Node) and node.target is aten.unsqueeze.default and node.args[1] == 0
    product = _unviewed(node.args[0]) if one_row else node
    if not isinstance(product, fx.Node) or product.target is not (aten.mm.default if one_row else aten.bmm.default):
        return None
    a, b = product.args
    m, k = a.meta["val"].shape[-2:]
    n = b.meta["val"].shape[-1]
    if k * (m + n) >= m * n:
        return None
    if one_row:
        with graph.inserting_before(node):
            a, b = (graph.call_function(aten.unsqueeze.default, (x, 0)) for x in (a, b))
        for x in (a, b):
            x.meta["val"] = x.args[0].meta["val"].unsqueeze(0)
            x.meta[REWRITE] = Rewrite.FACTOR
    return a, b


def _unviewed(node):
    """``node`` behind the views (``view``, ``_unsafe_view``, ``reshape``) that keep its shape."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ROW_VIEWS \
            and "val" in node.meta and node.meta["val"].shape == node.args[0].meta["val"].shape:
        node = node.args[0]
    return node
