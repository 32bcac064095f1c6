"""Give the ``vmap``-traced forward the kernels eager runs at the call's batch, so that a kept call returns the
module's own bits.

The per-row program is the one-row partition mapped over ``R`` rows. Eager runs the module once on all ``R`` rows;
the traced graph computes the same real-valued function, but where ``vmap`` batches an operator with other kernels
than eager's, the rounding differs.

``linear``. Eager's ``F.linear`` picks its kernels from the input it is given: ``addmm`` on the rows flattened when
they are contiguous, a copy first or a ``bmm`` when they are not (a slice of the attention's output is contiguous at
one row and not at ``R``), a fold into one product when the weight requires grad. At one row the partition has
already chosen, for one row. So the one-row partition is traced with each ``F.linear`` kept whole, as the operator
``leancompile::linear`` (:func:`keeping_whole`, autocast's casts made explicit before it), and its batching
rule calls ``F.linear`` on the rows of the whole call, laid out as eager's input is: ``vmap`` then traces the kernels
eager runs at that batch. Its gradient is the linear layer's (exact in real arithmetic; the backward's products
round as autograd's do up to their order). ``Tensor.contiguous()`` is kept whole the same way
(``leancompile::contiguous``): at one row it returns its input, at ``R`` rows eager copies (the attention's output
before its projection), and the copy decides the product's kernel. A floating ``full`` / ``zeros`` / ``ones`` of one
row is kept whole as ``leancompile::full_rows``: eager makes it at the call's batch (Flux's guidance,
``torch.full((batch,), g)``) and the products it feeds run over all rows, where ``vmap`` would compute it once and
its products at one row (float32 ``gemm`` rounds otherwise at ``M = 1``). Where the program runs without ``vmap``
(one row) the operators are traced as the functions they keep (:data:`EAGER_DECOMPOSITIONS`).

``addmm``. A linear layer is ``addmm(bias, x, W)`` at one row, and eager runs that one ``addmm`` on the rows of
the whole batch (``x`` flattened to ``[R * M, K]``). ``vmap``'s batching rule writes it as a product and an
addition: the product is rounded to the dtype before the bias is added (bf16: a second rounding; eager adds the
bias to the product's float32 accumulator)::

    %v = view(%x, [R * M, K]); %mm = mm(%v, %w); %p = _unsafe_view(%mm, [R, M, N])
    %b = mul.Scalar(%bias, 1); %y = add.Tensor(%b, %p)
    ->  %addmm = addmm(%bias, %v, %w); %y = _unsafe_view(%addmm, [R, M, N])

The ``mul.Scalar(bias, 1)`` is the rule's own mark (``beta * bias`` at ``beta = 1``): a product and an addition the
module writes itself (``x @ W + b``) carry no such factor and stay as eager runs them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .meta import REWRITE, Rewrite

aten = torch.ops.aten


@torch.library.custom_op("leancompile::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, kept whole through AOTAutograd's tracing."""
    return F.linear(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias):
    return F.linear(x, weight, bias)


def _linear_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad.matmul(weight) if need_x else None
    grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1])) if need_weight else None
    grad_bias = rows.sum(0) if need_bias and ctx.bias else None
    return grad_x, grad_weight, grad_bias


linear.register_autograd(_linear_backward, setup_context=_linear_context)


def _rows_merged(x: torch.Tensor) -> torch.Tensor:
    """``x`` (the mapped dimension first, then the one-row program's leading dimension) with both as one dimension,
    strided as eager's tensor of the whole call is: eager chooses kernels by strides, those of size-1 dimensions too
    (``matmul`` folds ``[R, 1, K]`` into one product only where ``stride(0) == stride(1)``), and ``flatten`` may give a
    size-1 dimension another stride."""
    rows, first = x.shape[:2]
    if first == 1:
        merged = x.stride(0)
    elif x.stride(0) == x.stride(1) * first:
        merged = x.stride(1)
    else:  # not one strided dimension: eager's tensor is a copy too
        return x.flatten(0, 1)
    return x.as_strided((rows * first, *x.shape[2:]), (merged, *x.stride()[2:]), x.storage_offset())


@linear.register_vmap
def _linear_rows(info, in_dims, x, weight, bias):
    """The rows of the whole call in one ``F.linear``, as eager is given them: the mapped dimension and the one-row
    program's own leading dimension (its batch of one) are one dimension."""
    x_dim, weight_dim, bias_dim = in_dims
    if weight_dim is not None or bias_dim is not None:  # per-row weights: one product per row
        rows = info.batch_size
        pick = lambda t, d, i: t if d is None else t.select(d, i)
        return torch.stack([F.linear(pick(x, x_dim, i), pick(weight, weight_dim, i), pick(bias, bias_dim, i))
                            for i in range(rows)]), 0
    x = x.movedim(x_dim, 0)
    if x.dim() < 3:  # one vector per row: the rows are the product's rows
        return F.linear(x, weight, bias), 0
    out = F.linear(_rows_merged(x), weight, bias)
    return out.unflatten(0, x.shape[:2]), 0


@torch.library.custom_op("leancompile::contiguous", mutates_args=())
def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, kept whole through AOTAutograd's tracing (a copy: an operator returns no alias)."""
    return x.clone(memory_format=torch.contiguous_format)


@contiguous.register_fake
def _contiguous_fake(x):
    return x.clone(memory_format=torch.contiguous_format)


contiguous.register_autograd(lambda ctx, grad: grad)


@contiguous.register_vmap
def _contiguous_rows(info, in_dims, x):
    """The whole call's rows laid out as eager's ``contiguous()`` lays them out: rows outermost."""
    return x.movedim(in_dims[0], 0).contiguous(), 0


def _full_rows_one(rows, size, value, dtype):
    return torch.full(size, value, dtype=dtype, device=rows.device)


@torch.library.custom_op("leancompile::full_rows", mutates_args=())
def full_rows(rows: torch.Tensor, size: list[int], value: float, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(size, value)`` whose leading size 1 is the call's one row: one per row under ``vmap`` (``rows``,
    a tensor of the call's rows, is read for its rows alone)."""
    return _full_rows_one(rows, size, value, dtype)


full_rows.register_fake(_full_rows_one)
full_rows.register_autograd(lambda ctx, grad: (None, None, None, None))


@full_rows.register_vmap
def _full_rows_rows(info, in_dims, rows, size, value, dtype):
    return torch.full([info.batch_size, *size], value, dtype=dtype, device=rows.device), 0


# Where a traced program calls the operators outside ``vmap`` (one row), they are traced as the functions they keep.
EAGER_DECOMPOSITIONS = {torch.ops.leancompile.linear.default: F.linear,
                        torch.ops.leancompile.contiguous.default: torch.Tensor.contiguous,
                        torch.ops.leancompile.full_rows.default: _full_rows_one}
_FILLS = {torch.full: None, torch.zeros: 0.0, torch.ones: 1.0}  # the value each fills with (full: its argument)


def _size(args) -> list[int] | None:
    size = args[0] if len(args) == 1 or not isinstance(args[0], int) else args
    return list(size) if isinstance(size, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in size) \
        else None


def _one_row_constant(func, args, kwargs, rows: torch.Tensor):
    """``full_rows`` for a floating ``full`` / ``zeros`` / ``ones`` whose leading size is 1, on ``rows``' device and
    with no other options; None for any other call."""
    full = func is torch.full
    size = _size(args[:1] if full else args)
    value = (args[1] if len(args) > 1 else kwargs.get("fill_value")) if full else _FILLS[func]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    # full infers an integer dtype from an integer value; zeros and ones take the default dtype
    dtype = kwargs.get("dtype") or (torch.get_default_dtype() if not full or isinstance(value, float) else None)
    device = torch.device(kwargs.get("device") or "cpu")
    if (not size or size[0] != 1 or set(kwargs) - {"dtype", "device", "fill_value"} or dtype is None
            or not dtype.is_floating_point or device != rows.device):
        return None
    return full_rows(rows, size, float(value), dtype)


def _whole_linear(args, kwargs) -> torch.Tensor:
    """``leancompile::linear`` for ``F.linear(*args, **kwargs)``, its inputs cast first as autocast casts them."""
    x, weight, bias = (*args, None, None)[:3]
    weight, bias = kwargs.get("weight", weight), kwargs.get("bias", bias)
    kind = x.device.type
    if torch.is_autocast_enabled(kind):  # autocast's linear: floating inputs but float64 to its dtype
        dtype = torch.get_autocast_dtype(kind)
        cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        x, weight, bias = cast(x), cast(weight), cast(bias)
    return linear(x, weight, bias)


class _Whole(TorchFunctionMode):
    def __init__(self, rows: torch.Tensor | None):
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS and self.rows is not None:
            made = _one_row_constant(func, args, kwargs, self.rows)
            if made is not None:
                return made
        if func is torch.Tensor.contiguous and len(args) == 1 and \
                kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format:
            return contiguous(args[0])
        if func is F.linear:
            return _whole_linear(args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def keeping_whole(rows: torch.Tensor | None = None):
    """Inside, ``F.linear`` traces as ``leancompile::linear`` (its input cast as autocast casts it),
    ``Tensor.contiguous()`` as ``leancompile::contiguous`` and, given a tensor ``rows`` of the call's rows, a
    floating ``full`` / ``zeros`` / ``ones`` of one row as ``leancompile::full_rows``."""
    with _Whole(rows):
        yield


def fuse_biases_into_products(gm: fx.GraphModule) -> int:
    """Rewrite each ``add(mul(bias, 1), mm(...))`` ``vmap`` made of an ``addmm`` back into that ``addmm``; returns
    how many."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs:
            fused += _fuse(gm.graph, node)
    if fused:
        gm.graph.eliminate_dead_code()
    return fused


def _unit_scaled(node) -> fx.Node | None:
    """``bias`` where ``node`` is ``mul.Scalar(bias, 1)`` read only by its addition."""
    if (isinstance(node, fx.Node) and node.target is aten.mul.Scalar and len(node.users) == 1
            and isinstance(node.args[0], fx.Node) and not isinstance(node.args[1], bool) and node.args[1] == 1):
        return node.args[0]
    return None


def _product(node) -> tuple[fx.Node, fx.Node | None] | None:
    """``(mm, view)`` where ``node`` is ``mm(...)`` or ``_unsafe_view(mm(...))`` (``view`` None), each read once."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    view = None
    if node.target is aten._unsafe_view.default:
        view, node = node, node.args[0]
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
    return (node, view) if node.target is aten.mm.default else None


def _fuse(graph: fx.Graph, add: fx.Node) -> int:
    for first, second in (add.args, add.args[::-1]):
        bias, found = _unit_scaled(first), _product(second)
        if bias is None or found is None:
            continue
        mm, view = found
        b, p = bias.meta.get("val"), mm.meta.get("val")
        if not (isinstance(b, torch.Tensor) and isinstance(p, torch.Tensor)) or b.dtype != p.dtype \
                or b.dim() != 1 or b.shape[0] != p.shape[-1] or add.meta["val"].dtype != p.dtype:
            return 0
        with graph.inserting_before(add):
            addmm = graph.call_function(aten.addmm.default, (bias, *mm.args))
            result = addmm if view is None else graph.call_function(aten._unsafe_view.default,
                                                                    (addmm, *view.args[1:]))
        addmm.meta.update(val=p, **{REWRITE: Rewrite.FUSED})
        result.meta.update(val=add.meta["val"], **{REWRITE: Rewrite.FUSED})
        add.replace_all_uses_with(result)
        graph.erase_node(add)
        return 1
    return 0
