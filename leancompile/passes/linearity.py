"""Linearity: is the update's loss affine in the advantages at ratio == 1?

Reweight backpropagates each trained step during the rollout with a provisional advantage and rescales the
gradient once the true advantages are known; that is exact only if the loss is affine in A where it is
evaluated. This pass walks every node that depends on the ``advantages`` placeholder and accepts only:
row moves (index, view, cast), ``neg``, ``mul``/``div`` by an A-free factor, ``add``/``sub``, ``mean``/``sum``,
and a ``maximum``/``minimum`` of ``c * ratio`` and ``c * clamp(ratio, lo, hi)`` with ``lo <= 1 <= hi`` (PPO's
clip): at ratio == 1 its two branches are equal, so it is linear there. The summands of the loss that do not
depend on A (e.g. the KL penalty) are the advantage-free terms.

Writes ``node.meta[LINEARITY]``: ``Linear.AFFINE`` on A-dependent nodes, ``Linear.TIE`` on the proven max/min.

Before: ``loss = mean(maximum(-A * r, -A * clamp(r, 1 - e, 1 + e))) + beta * kl``
After:  ``Linearity(affine=True, ties=("maximum",), advantage_free=("mul_131",))``
"""
from __future__ import annotations


import torch.fx as fx

from ..plan import Linearity
from .shared import _ROW_OPS
from .graph import ancestors, op_name
from .meta import INPUT, LINEARITY, Linear

_LINEAR_UNARY = _ROW_OPS | {"neg.default", "mean.default", "mean.dim", "sum.default", "sum.dim_IntList"}
_ADDITIVE = {"add.Tensor", "sub.Tensor"}
_SCALING = {"mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar"}
_TIES = {"maximum.default", "minimum.default"}


def _clamp_ratio(node) -> tuple[fx.Node, float, float] | None:
    if isinstance(node, fx.Node) and op_name(node) == "clamp.default":
        lo, hi = (list(node.args[1:]) + [None, None])[:2]
        if lo is not None and hi is not None:
            return node.args[0], float(lo), float(hi)
    return None


def _ties_at_ratio_one(node: fx.Node, depends) -> bool:
    """``max(c * r, c * clamp(r, lo, hi))`` with the same A-dependent ``c`` and ``lo <= 1 <= hi``."""
    a, b = node.args[:2]
    if not all(isinstance(x, fx.Node) and op_name(x) == "mul.Tensor" for x in (a, b)):
        return False

    def split(m):
        x, y = m.args
        return (x, y) if depends(x) else (y, x)

    (ca, ra), (cb, rb) = split(a), split(b)
    if ca is not cb and not (op_name(ca) == op_name(cb) == "neg.default" and ca.args[0] is cb.args[0]):
        return False
    for plain, clamped in ((ra, rb), (rb, ra)):
        c = _clamp_ratio(clamped)
        if c is not None and c[0] is plain and c[1] <= 1 <= c[2]:
            return True
    return False


def _summands(node: fx.Node) -> list[fx.Node]:
    if node.op == "call_function" and op_name(node) in _ADDITIVE and all(isinstance(a, fx.Node) for a in node.args[:2]):
        return _summands(node.args[0]) + _summands(node.args[1])
    return [node]


def check_linearity(update: fx.GraphModule) -> Linearity:
    """Prove (or refute) that the traced update's loss is affine in its ``advantages`` input at ratio == 1."""
    nodes = list(update.graph.nodes)
    adv = [n for n in nodes if n.meta.get(INPUT) == "data:advantages"]
    output = nodes[-1]
    loss = output.args[0][0] if isinstance(output.args[0], (list, tuple)) else output.args[0]
    if not adv:
        return Linearity(False, "the update reads no advantages input", (), ())
    feeds_loss = ancestors(loss)
    dependent = {adv[0]}
    depends = dependent.__contains__
    ties = []
    for node in nodes:
        if node not in feeds_loss or node.op != "call_function" or not any(depends(a) for a in node.all_input_nodes):
            continue
        dependent.add(node)
        name = op_name(node)
        inputs = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if name in _LINEAR_UNARY or name in _ADDITIVE:
            ok = True
        elif name in _SCALING:
            ok = sum(depends(a) for a in inputs) == 1 and (name.startswith("mul") or depends(node.args[0]))
        elif name in _TIES:
            ok = _ties_at_ratio_one(node, depends)
            if ok:
                ties.append(node.name)
        else:
            ok = False
        if not ok:
            return Linearity(False, f"{node.name} ({name}) is not linear in the advantages", tuple(ties), ())
        node.meta[LINEARITY] = Linear.TIE if node.name in ties else Linear.AFFINE
    free = tuple(n.name for n in _summands(loss) if n not in dependent)
    row_mean = not any(op_name(n).startswith("sum.") for n in dependent if n.op == "call_function")
    return Linearity(True, None, tuple(ties), free, row_mean)
